"""gspo: Group Sequence Policy Optimization (arXiv 2507.18071) for RL fine-tuning of LMs."""

__version__ = "0.1.0"
