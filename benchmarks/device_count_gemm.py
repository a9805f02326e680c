"""The heavy rows' GEMMs with their row count on the device, against cuBLAS on a row count the
host knows: is a training op with no host read and no capacities affordable?

The training op's heavy rows (those with more active units than the threshold) take dense GEMMs.
Today their row count comes from the host: the capacity path runs cuBLAS over a capacity of rows
(zero rows past the count) and reads the true sizes on the host in the backward, where an
overflowed capacity rebuilds the records (docs/multi_gpu.md, "Where a layer's host time goes").
A GEMM that reads its row count on the device needs neither: `torch._grouped_mm` (CUTLASS's
grouped GEMM on Hopper) with one group whose offset is a device tensor computes the first `n`
rows of a buffer of M rows, whatever M; its reduction form (the offset along K) gives the weight
gradients over the first `n` rows. With every buffer M rows long no count can overflow, and the
backward could recompute the heavy rows' gate and up values from x instead of keeping a record.

For each count `n` of M rows this times, at the 1b layer's shapes (D 2048, H 5632), the op's three
GEMM shapes: `rows` (x_h [n, D] @ W^T [D, H], the up and gate GEMMs and the backward's dh), `down`
([n, H] @ [H, D], the down GEMM and dx) and `reduce` ([H, n] @ [n, D], a weight gradient); cuBLAS
(`torch.mm`) on the op's padded row count against `torch._grouped_mm` on the M-row buffers with
the count on the device, and the largest difference between their results (relative to cuBLAS's
largest value).

    python -m benchmarks.device_count_gemm --json out.json --md out.md
    python -m benchmarks.device_count_gemm --tiny   # CPU, small shapes: the script end to end
"""

from __future__ import annotations

from typing import Any

import torch

from benchmarks import common

FULL = dict(m=16384, d=2048, h=5632, counts=(0, 64, 256, 1024, 2048, 4096, 8192, 16384))
TINY = dict(m=256, d=64, h=96, counts=(0, 16, 100))
ROW_GRANULE = 64  # the op's heavy GEMMs pad their rows to this (kernels/torch_glue.h)
KINDS = ("rows", "down", "reduce")


def parse_args(argv: list[str] | None = None):
    p = common.script_parser(__doc__)
    p.add_argument("--tiny", action="store_true", help="CPU, small shapes (the script end to end)")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--reps", type=int, default=20)
    return p.parse_args(argv)


def padded(n: int) -> int:
    return -(-n // ROW_GRANULE) * ROW_GRANULE


def operands(kind: str, m: int, d: int, h: int, device: torch.device, generator: torch.Generator):
    """The M-row buffer and the other operand of a GEMM kind, bf16, in the layouts the op has: the
    weights [H, D] or [D, H] row-major read transposed, the weight gradient's left operand the
    transpose of an [M, H] buffer."""

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=generator, device=device).to(torch.bfloat16)

    if kind == "rows":  # [M, D] @ ([H, D] weight)^T
        return randn(m, d), randn(h, d).t()
    if kind == "down":  # [M, H] @ ([D, H] weight)^T
        return randn(m, h), randn(d, h).t()
    return randn(m, h), randn(m, d)  # reduce: buffer^T [H, M] @ [M, D]


def cublas_call(kind: str, a: torch.Tensor, b: torch.Tensor, n: int):
    """The op's GEMM today: cuBLAS over the padded count of rows, known on the host."""
    rows = padded(n)
    if kind == "reduce":
        a_rows, b_rows = a[:rows], b[:rows]
        return lambda: torch.mm(a_rows.t(), b_rows)
    a_rows = a[:rows]
    return lambda: torch.mm(a_rows, b)


def grouped_call(kind: str, a: torch.Tensor, b: torch.Tensor, count: torch.Tensor):
    """The same GEMM over the whole M-row buffer with the count on the device (one group)."""
    if kind == "reduce":
        return lambda: torch._grouped_mm(a.t(), b, offs=count)[0]
    b3 = b.unsqueeze(0)
    return lambda: torch._grouped_mm(a, b3, offs=count)


def bench(kind: str, n: int, shape: dict[str, Any], device: torch.device, args) -> dict[str, Any]:
    generator = torch.Generator(device=device).manual_seed(n)
    a, b = operands(kind, shape["m"], shape["d"], shape["h"], device, generator)
    count = torch.tensor([n], dtype=torch.int32, device=device)
    cublas, grouped = cublas_call(kind, a, b, n), grouped_call(kind, a, b, count)
    row: dict[str, Any] = {"kind": kind, "count": n, "m": shape["m"], "padded": padded(n)}
    want = cublas()
    try:
        got = grouped()
        if device.type == "cuda":
            torch.cuda.synchronize()  # an error the kernel raises as it runs belongs to this row too
    except RuntimeError as error:  # a layout, shape or size the grouped GEMM refuses: say so, go on
        return row | {
            "ms_cublas": common.median_ms(cublas, device, args.warmup, args.reps),
            "error": " ".join(str(error).split()).replace("|", "/"),  # one line of a Markdown cell
        }
    if kind == "reduce":
        # The padded rows past n are real data here, so compare with cuBLAS over exactly n rows.
        want = torch.mm(a[:n].t(), b[:n])
        diff = (got.float() - want.float()).abs().max()
    else:
        diff = (got[:n].float() - want[:n].float()).abs().max() if n else torch.zeros(())
    scale = want.float().abs().max().clamp_min(1e-30) if want.numel() else torch.ones(())
    ms_cublas = common.median_ms(cublas, device, args.warmup, args.reps)
    ms_grouped = common.median_ms(grouped, device, args.warmup, args.reps)
    return row | {
        "ms_cublas": ms_cublas,
        "ms_grouped": ms_grouped,
        "grouped_over_cublas": ms_grouped / ms_cublas,
        "max_rel_diff": float(diff / scale),
    }


def report(rows: list[dict[str, Any]], shape: dict[str, Any], meta: dict[str, Any]) -> str:
    lines = [
        f"# The heavy rows' GEMMs with their count on the device: {meta.get('device')}",
        "",
        f"Commit {meta.get('commit')}, {meta.get('date')}, torch {meta.get('torch')}. "
        f"M {shape['m']}, D {shape['d']}, H {shape['h']}, bf16; cuBLAS (`torch.mm`) over the padded count "
        f"(granule {ROW_GRANULE}, known on the host) against `torch._grouped_mm` over all M rows with the count "
        "on the device; median ms a call; difference: the largest, relative to cuBLAS's largest value.",
        "",
        "| GEMM | count | padded | cuBLAS ms | grouped ms | grouped / cuBLAS | difference |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        if "error" in r:
            lines.append(
                f"| {r['kind']} | {r['count']} | {r['padded']} | {r['ms_cublas']:.3f} | refused: {r['error'][:60]} | | |"
            )
            continue
        lines.append(
            f"| {r['kind']} | {r['count']} | {r['padded']} | {r['ms_cublas']:.3f} | {r['ms_grouped']:.3f} "
            f"| {r['grouped_over_cublas']:.2f} | {r['max_rel_diff']:.1e} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    args = parse_args(argv)
    device = common.bench_device(cpu=args.tiny)
    if not args.tiny and device.type != "cuda":
        raise SystemExit("device_count_gemm: needs a CUDA GPU (or --tiny on the CPU)")
    shape = TINY if args.tiny else FULL
    cases = [(kind, n) for kind in KINDS for n in shape["counts"]]
    rows = common.measure_cases(
        cases,
        lambda kind, n: bench(kind, n, shape, device, args),
        lambda kind, n, row: f"{kind} {n}: {row.get('grouped_over_cublas', 'refused')}",
    )
    meta = common.run_meta(device, m=shape["m"], d=shape["d"], h=shape["h"])
    common.write_report(report(rows, shape, meta), meta, rows, args.json, args.md)
    return rows


if __name__ == "__main__":
    main()
