"""Downstream evaluation: lm-evaluation-harness tasks on our models, through our inference path.

    sparse-llm-eval runs/my_run --tasks paper          # or python -m sparse_llm.eval (cli.py)

lm.py       SparseLM, lm-eval's model interface over our model (needs lm-eval)
harness.py  lm-eval itself: installed or not, presets, task names, one evaluation
results.py  where results go (eval/<step>.json, .md) and the metrics a run logs
compare.py  runs side by side: a table and a bar plot
tasks/      the tasks that ship with the package (offline)

lm-eval is optional (`pip install "sparse-llm[eval]"`); nothing here imports it at import time
but lm.py. During training, eval.downstream runs the same evaluation
(DownstreamEvalCallback, sparse_llm/training/callbacks.py).
"""
