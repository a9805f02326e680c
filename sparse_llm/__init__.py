"""sparse-llm: pretraining of Llama-style models with >99% sparse ReLU-gated feed-forward blocks.

Kept import-light on purpose: `import sparse_llm.ops` must work on a GPU box that has only
torch, and the trainer's heavy dependencies load only where they are used.
"""

__version__ = "0.1.0"
