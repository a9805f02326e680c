"""Downstream evaluation: lm-evaluation-harness tasks on our models, through our inference path.

lm.py       SparseLM, lm-eval's model interface over our model (needs lm-eval)
harness.py  lm-eval itself: installed or not, presets, task names, one evaluation
tasks/      the tasks that ship with the package (offline)

lm-eval is optional (`pip install "sparse-llm[eval]"`); nothing here imports it at import time
but lm.py.
"""
