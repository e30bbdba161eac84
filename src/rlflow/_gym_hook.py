"""Make ``gym.make("rlflow/GraphRewrite-v0")`` work without ``import rlflow`` on Gymnasium 1.x.

Gymnasium 0.26-0.29 loaded third-party registrations from the ``gymnasium.envs`` entry-point group; 1.0 removed
that loader, and its registry is a plain dict with no lookup hook. The installed distribution therefore ships
``rlflow-gymnasium.pth`` (see ``setup.py``), which the interpreter runs at start-up; it imports this module, and
this module does nothing but put one finder at the front of ``sys.meta_path``. The finder answers no import
itself: when ``gymnasium`` is first imported it wraps that module's loader so that, once ``gymnasium`` has
finished loading, :func:`rlflow.env.register_envs` adds the id (which imports only ``rlflow.env``'s small
``__init__``; the environment class loads when an env is made). Then the finder removes itself. A process that
never imports gymnasium pays for importing this file and nothing else.
"""

import sys


class _GymnasiumWatcher:
    """A meta-path finder (duck-typed: importing importlib.abc would cost every interpreter start ~20 ms)."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname != "gymnasium":
            return None
        sys.meta_path.remove(self)
        for finder in sys.meta_path:
            spec = finder.find_spec(fullname, path, target) if hasattr(finder, "find_spec") else None
            if spec is not None:
                break
        else:
            return None
        loader = spec.loader
        if loader is None or not hasattr(loader, "exec_module"):
            return spec
        original = loader.exec_module

        def exec_module(module):
            original(module)
            _register()

        loader.exec_module = exec_module
        return spec


def _register() -> None:
    try:
        from rlflow.env import register_envs
    except ImportError:  # a broken install must not break every program that imports gymnasium
        return
    register_envs()


def install() -> None:
    """Register now if gymnasium is already imported, else when it is."""
    if "gymnasium" in sys.modules:
        _register()
    elif not any(isinstance(f, _GymnasiumWatcher) for f in sys.meta_path):
        sys.meta_path.insert(0, _GymnasiumWatcher())


install()
