"""PNG summary of a ``pagedkv bench`` run (needs matplotlib, extra ``bench``)."""
from __future__ import annotations

from typing import List

from pagedkv.benchmarks.report import short_dtype

COLORS = {"pagedkv": "tab:blue", "numpy": "tab:orange", "numpy-gather": "tab:green",
          "torch-sdpa": "tab:red", "torch": "tab:red", "kv-pattern read": "tab:gray"}


def plot_results(results: dict, path: str) -> None:
    """Decode %BW against context length (one panel per dtype and thread
    count), prefill GFLOP/s and append µs per call (bars)."""
    import matplotlib  # noqa: PLC0415 - optional dependency

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    recs: List[dict] = results["records"]
    decode = [r for r in recs if r["suite"] == "decode"]
    prefill = [r for r in recs if r["suite"] == "prefill"]
    append = [r for r in recs if r["suite"] == "append"]
    panels = sorted({(r["dtype"], r["threads"]) for r in decode})
    ncol = max(2, len({t for _, t in panels}) if panels else 2)
    nrow_dec = len({d for d, _ in panels})
    nrow = nrow_dec + 1
    fig, axes = plt.subplots(nrow, ncol, figsize=(6 * ncol, 4 * nrow), squeeze=False)
    dtypes = sorted({d for d, _ in panels})
    threads = sorted({t for _, t in panels})
    for d, t in panels:
        ax = axes[dtypes.index(d)][threads.index(t)]
        rs = [r for r in decode if r["dtype"] == d and r["threads"] == t]
        for bi, B in enumerate(sorted({r["B"] for r in rs}, reverse=True)):
            style = ("-", "--", ":", "-.")[bi % 4]
            rb = sorted((r for r in rs if r["B"] == B), key=lambda r: r["L"])
            if not rb:
                continue
            for name in ("pagedkv", "kv-pattern read", "numpy", "numpy-gather", "torch-sdpa"):
                pts = [(r["L"], r["results"][name]["gbps"]) for r in rb if name in r["results"]]
                if pts:
                    ax.plot(*zip(*pts), style, marker="o", color=COLORS[name],
                            label=f"{name} B={B}")
        bw = results.get("bandwidth", {}).get(str(t))
        if bw:
            ax.axhline(bw / 1e9, color="gray", linestyle=":", label="measured read BW")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("context length L")
        ax.set_ylabel("GB/s (K+V bytes read per step / time)")
        ax.set_title(f"decode {d}, {t} thread(s)")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
    for row in range(nrow_dec):
        for col in range(len(threads), ncol):
            axes[row][col].axis("off")
    _bars(axes[nrow - 1][0], prefill, "gflops", "GFLOP/s (useful)", "prefill, causal",
          lambda r: f"{short_dtype(r['dtype'])} L={r['L']} t={r['threads']}",
          ("pagedkv", "numpy", "torch-sdpa"))
    _bars(axes[nrow - 1][1], append, "us_per_call", "µs per call", "append (1 thread)",
          lambda r: (f"{short_dtype(r['dtype'])} {r['call']} B={r['B']}"
                     + (f" as {short_dtype(r['kv_dtype'])}"
                        if r.get("kv_dtype", r["dtype"]) != r["dtype"] else "")),
          ("pagedkv", "numpy", "torch"))
    for col in range(2, ncol):
        axes[nrow - 1][col].axis("off")
    meta = results.get("meta", {})
    fig.suptitle(f"pagedkv {meta.get('pagedkv', '')} bench - {meta.get('cpu', '')}, "
                 f"SIMD {meta.get('simd_backend', '')}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _bars(ax, recs, key, ylabel, title, label, names) -> None:
    if not recs:
        ax.axis("off")
        return
    width = 0.8 / len(names)
    for j, name in enumerate(names):
        xs, ys = [], []
        for i, r in enumerate(recs):
            res = r["results"].get(name)
            if res is not None:
                xs.append(i + (j - (len(names) - 1) / 2) * width)
                ys.append(res[key])
        if xs:
            ax.bar(xs, ys, width=width, color=COLORS[name], label=name)
    ax.set_xticks(range(len(recs)))
    ax.set_xticklabels([label(r) for r in recs], rotation=30, ha="right", fontsize=7)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(True, axis="y", alpha=0.3)
    ax.legend(fontsize=7)
