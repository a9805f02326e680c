"""benchmarks/block_kernels.py: the block op's variants timed on a tiny model's layers (CPU), and
the kernel table summed over layers from per-kernel times."""

from __future__ import annotations

import json

from benchmarks.block_kernels import kernel_totals, main, markdown


def test_tiny_end_to_end(tmp_path):
    args = ["--tiny", "--warmup", "1", "--reps", "1", "--sets", "1", "--layers", "1"]
    rows = main([*args, "--json", str(tmp_path / "r.json"), "--md", str(tmp_path / "r.md")])
    assert [r["layer"] for r in rows] == [1]
    written = json.loads((tmp_path / "r.json").read_text())
    # On the CPU: the reference op, no capacity path, event times only.
    assert written["timing"] == "ms" and written["block_over_op"] > 0
    assert set(written["meta"]["totals"]) == {"op", "block", "dense_block"}
    assert "block_mode" in written["meta"] and "| sum |" in (tmp_path / "r.md").read_text()


def test_compiled_blocks_compile_as_the_trainer_does(tmp_path):
    # A plain torch.compile breaks the graph at the sparse op and runs the block eager: the
    # benchmark compiles as the trainer does, with no break.
    args = ["--tiny", "--compile", "--warmup", "1", "--reps", "1", "--sets", "1", "--layers", "0"]
    main([*args, "--json", str(tmp_path / "r.json")])
    meta = json.loads((tmp_path / "r.json").read_text())["meta"]
    assert meta["block_mode"] == "compiled"
    assert meta["graph_breaks"] == 0 and meta["graphs"] >= 1


def test_kernel_table_ranks_by_what_the_block_adds():
    def variant(us: dict[str, float]) -> dict:
        return {"gpu_ms": sum(us.values()) / 1000, "kernel_us": us}

    rows = [
        {
            "layer": i,
            "l0": 10.0,
            "hot_units": 64,
            "op": variant({"gemm": 100.0}),
            "dense_block": variant({"gemm": 300.0}),
            **{
                v: variant({"gemm": 100.0, "cast": 50.0 * (i + 1)})
                for v in ("block", "block_cap", "block_cap_hot")
            },
        }
        for i in range(2)
    ]
    assert kernel_totals(rows, "block_cap") == {"gemm": 200.0, "cast": 150.0}
    meta = {
        "device": "d",
        "commit": "c",
        "date": "t",
        "model": "m",
        "tokens": 8,
        "text": "x",
        "impl": "cuda",
        "share": 0.01,
        "block_mode": "eager",
        "graph_breaks": 0,
        "graphs": 0,
        "dense_mode": "compiled",
        "totals": {
            v: sum(r[v]["gpu_ms"] for r in rows)
            for v in ("op", "block", "block_cap", "block_cap_hot", "dense_block")
        },
    }
    text = markdown(meta, rows, top=1)
    table = text.split("Kernel by kernel")[1]
    # cast first (+0.15 ms over the op), then the rest (gemm: +0.00)
    assert table.index("| cast |") < table.index("| gemm |")
    assert "| cast | 0.00 | 0.15 | 0.15 | 0.15 | 0.00 | +0.15 |" in table
