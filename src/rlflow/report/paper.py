"""The published numbers the report shows beside this run's, each with its source.

Transcribed from the papers of RLFlow (Parker, Alabed, Yoneki), X-RLflow (He, Parker, Yoneki, MLSys 2023), TASO
(Jia et al., SOSP 2019) and Tensat (Yang et al., MLSys 2021), as collected in the project's ``REFERENCES.md``.
They are the only numbers in the report that do not come from this run's files. The papers measured on GPUs
(RLFlow: RTX 2070; TASO: V100), so they are for orientation, not for a like-for-like comparison with a run on
other hardware.
"""

from __future__ import annotations

RLFLOW = "RLFlow (Parker, Alabed, Yoneki)"
X_RLFLOW = "X-RLflow (He, Parker, Yoneki, MLSys 2023)"
TASO = "TASO (Jia et al., SOSP 2019)"
TENSAT = "Tensat (Yang et al., MLSys 2021)"

#: our zoo model -> the model's name in the RLFlow paper (only the models it measured)
RLFLOW_MODEL = {"bert": "BERT-Base", "vit": "ViT-Base", "resnet18": "ResNet18", "resnet50": "ResNet50",
                "squeezenet": "SqueezeNet1.1", "inceptionv3": "InceptionV3"}

#: RLFlow, Table 2: improvement of RLFlow over TensorFlow, (inference latency %, memory %)
RLFLOW_TABLE2 = {"ResNet18": (5.2, 1.1), "ResNet50": (-1.6, 0.6), "InceptionV3": (17.1, 2.3),
                 "SqueezeNet1.1": (17.6, 1.8), "BERT-Base": (32.4, 4.5), "ViT-Base": (30.7, 3.2)}
RLFLOW_TABLE2_SOURCE = f"{RLFLOW}, Table 2 (improvement of RLFlow vs TensorFlow, %)"

#: RLFlow, reported inference latencies in ms on an RTX 2070, per system
RLFLOW_LATENCY_SYSTEMS = ("TensorFlow", "TensorRT", "TASO", "model-free", "RLFlow")
RLFLOW_LATENCY_MS = {
    "SqueezeNet1.1": (4.83, 3.85, 3.68, 3.72, 3.98),
    "ResNet18": (12.55, 10.71, 11.39, 11.62, 11.90),
    "ResNet50": (26.07, 21.89, 24.61, 25.96, 26.48),
    "InceptionV3": (20.14, 15.93, 15.85, 16.50, 16.69),
    "BERT-Base": (4.41, 3.81, 3.06, 3.01, 2.98),
    "ViT-Base": (3.81, 3.42, 2.84, 2.83, 2.64),
}
RLFLOW_LATENCY_SOURCE = f"{RLFLOW}, reported end-to-end inference latencies (ms, RTX 2070)"

#: RLFlow, optimisation time in seconds: (TASO, RLFlow)
RLFLOW_OPT_TIME_S = {"SqueezeNet1.1": (23.1, 8.0), "ResNet18": (10.0, 4.5), "ResNet50": (1099.0, 64.3),
                     "InceptionV3": (654.0, 50.4), "BERT-Base": (10.8, 6.6), "ViT-Base": (9.7, 6.0)}
RLFLOW_OPT_TIME_SOURCE = f"{RLFLOW}, reported optimisation times (s)"

#: RLFlow, sample efficiency: real-environment interactions of each agent (approximate, as the paper states them)
RLFLOW_INTERACTIONS = {"model-free": 4_000_000, "RLFlow (model-based)": 1_000_000}
#: RLFlow: one world-model step vs one real-environment step on ResNet-50 (ms), i.e. 85x
RLFLOW_STEP_MS = {"world model": 10.0, "real environment (ResNet-50)": 850.0}
RLFLOW_SAMPLE_SOURCE = f"{RLFLOW}, sample efficiency (~4M vs ~1M real interactions; ~10 ms vs ~850 ms per step)"
#: the model-based claim as this project tests it: the controller trained in the dream reaches at least this share
#: of the model-free agent's improvement with at most this share of its real interactions (RLFlow: ~1M of ~4M)
CLAIM_MIN_GAIN_SHARE = 0.95
CLAIM_MAX_INTERACTION_SHARE = 0.25

#: RLFlow, Table 3: the temperatures swept and the best one (the paper gives no per-temperature numbers here)
RLFLOW_TEMPERATURES = (0.1, 0.5, 0.75, 1.0, 1.2, 1.5, 1.75, 2.0, 2.5, 3.0)
RLFLOW_BEST_TEMPERATURE = 1.5
RLFLOW_TEMPERATURE_SOURCE = f"{RLFLOW}, Table 3 (temperature sweep; best real score at tau 1.5)"

#: RLFlow, Fig. 5 / eq. 3: the reward weights its grid search found best
RLFLOW_REWARD_WEIGHTS = {"alpha": 0.8, "beta": 0.2}
RLFLOW_REWARD_SOURCE = (f"{RLFLOW}, reward functions eq. 2 (runtime saved) and eq. 3 (weighted; its grid "
                        "search found alpha 0.8, beta 0.2 best)")

#: RLFlow: MDN-RNN and training settings (for the world-model figure's caption)
RLFLOW_WORLD_MODEL = "8 Gaussians, 256 LSTM units, learning rate decayed over 5000 epochs"

#: X-RLflow: cost model vs end-to-end latency, (cost-model ms, end-to-end ms, difference %); diff = |E2E - cost| / cost
X_RLFLOW_COST_DISCREPANCY = {"DALL-E": (1.8269, 1.7324, 5.2), "InceptionV3": (8.3650, 9.2098, 10.1),
                             "BERT": (1.0453, 1.1264, 7.8), "SqueezeNet": (1.3082, 1.4006, 7.1),
                             "ResNeXt-50": (6.1545, 7.6498, 24.0), "T-T": (2.4828, 2.7281, 9.9)}
X_RLFLOW_COST_SOURCE = f"{X_RLFLOW}, cost model vs end-to-end latency (GPU)"
#: our zoo model -> its row in X-RLflow's discrepancy table
X_RLFLOW_MODEL = {"bert": "BERT", "inceptionv3": "InceptionV3", "squeezenet": "SqueezeNet", "resnext50": "ResNeXt-50"}

#: TASO: published speedups over the best of TF / TF-XLA / TensorRT (V100)
TASO_SPEEDUP = {"BERT-base": 1.5, "ResNeXt-50": 3.1, "NasNet-A": 1.3, "SqueezeNet": 1.3, "Inception-v3": 1.1}
TASO_MODEL = {"bert": "BERT-base", "resnext50": "ResNeXt-50", "squeezenet": "SqueezeNet", "inceptionv3": "Inception-v3"}
TASO_SPEEDUP_SOURCE = f"{TASO}, end-to-end speedup vs the best of TF / TF-XLA / TensorRT (V100)"

#: TASO: rule counts (the RL papers' action space is the 151 of the repository; NO-OP id 151)
TASO_RULES = {"substitutions generated and verified (paper)": 743, "rules shipped in the repository": 133,
              "hand-written transforms": 18, "actions in the RL papers (133 + 18)": 151}
TASO_RULES_SOURCE = f"{TASO}: ~5 min generation, ~10 min verification; repository rule file"

#: Tensat (equality saturation over TASO's rules, ILP extraction) against TASO's search: up to this much more
#: speedup (%), and on average this many times less optimisation time (the paper gives no per-model table here)
TENSAT_MORE_SPEEDUP_PCT = 16
TENSAT_TIME_FACTOR = 48
TENSAT_VS_TASO_SOURCE = (f"{TENSAT}: up to {TENSAT_MORE_SPEEDUP_PCT}% more speedup than TASO, on average "
                         f"{TENSAT_TIME_FACTOR}x less optimisation time")
#: Tensat's saturation limits and rule set
TENSAT_SETTINGS = {"node limit": 50_000, "iterations": 15, "single-pattern rules (TASO's)": 120,
                   "multi-pattern rules": 13}
