"""Neural networks: the graph encoder (PyTorch Geometric), the MDN-RNN world model, policy/value heads."""
