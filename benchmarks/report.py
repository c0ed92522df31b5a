"""Tables, findings and plots from the jobs' JSON files (``python -m benchmarks`` writes them all).

Every number here is read from a run: times and ratios from the same job (same model, batch and world),
memory and bytes per rank as measured by ``benchmarks.measure``.
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path
from typing import Any

from passes.analysis.search_plans import prediction_accuracy

log = logging.getLogger(__name__)

MIB = 2.0**20
PEER_NAMES = {"serial": "serial", "ddp": "DDP", "fsdp2": "FSDP2", "tp": "DTensor TP", "pipe": "torch pipelining"}
LOSS_RTOL = 1e-4
"""fp32: every system's loss at every step within this relative distance of serial's. The first step
starts from identical parameters, so only the order of sums differs (about 1e-7); AdamW then carries
such roundoff from step to step (autopar t4x1x1 on FC_Net: first-step gradients within 5e-7 of
serial's, losses 1.1e-5 apart after 13 steps). lr 1e-4 keeps AdamW out of the regime where the
differences grow quickly; a missing or doubled gradient sum moves the losses by far more."""


def label(system: str) -> str:
    return f"autopar {system.split(':', 1)[1]}" if system.startswith("autopar:") else PEER_NAMES[system]


def same_plan_peer(system: str, world: int) -> str | None:
    from benchmarks.systems import parse_grid

    if not system.startswith("autopar:"):
        return None
    return parse_grid(system.split(":", 1)[1], world).same_plan_peer()


def checks(job: dict[str, Any]) -> list[str]:
    """What this job got wrong: losses that left serial's, bytes that differ from autopar's own count or
    from the trace's prediction, collectives the counter did not know. Empty when all hold."""
    problems = []
    ok = {s["system"]: s for s in job["systems"] if s["status"] == "ok"}
    where = f"{job['model']} on {job['world']} ranks"
    serial = ok.get("serial")
    for name, s in ok.items():
        if serial is not None and (err := loss_error(s, serial)) > LOSS_RTOL:
            problems.append(f"{where}: {label(name)}'s losses leave serial's by {err:.1e} (relative)")
        for rank, r in enumerate(s["ranks"]):
            if r["uncounted_ops"]:
                problems.append(f"{where}: {label(name)} rank {rank} ran collectives the counter does not "
                                f"know: {', '.join(r['uncounted_ops'])}")
            if "autopar_comm_stats" in r and not _equal(r["comm_bytes"], r["autopar_comm_stats"]):
                problems.append(f"{where}: {label(name)} rank {rank} sent {r['comm_bytes']:,.0f} B but "
                                f"autopar.comm_stats() says {r['autopar_comm_stats']:,.0f} B")
            # (the experts' all-to-alls move what the routing sends, the prediction assumes a balanced one: the rest
            # is compared, the exchange shown beside it, ``exchange_notes``)
            exchange = r.get("comm_by_kind", {}).get("all_to_all", 0.0)
            if r.get("predicted_bytes") is not None and not _equal(
                    r["comm_bytes"] - exchange, r["predicted_bytes"] - r.get("predicted_all_to_all", 0.0)):
                problems.append(f"{where}: {label(name)} rank {rank} sent {r['comm_bytes']:,.0f} B; the trace "
                                f"predicted {r['predicted_bytes']:,.0f} B")
    problems += [f"{where}: {label(s['system'])} failed: {s['reason']}" for s in job["systems"]
                 if s["status"] == "error"]
    return problems


def _equal(a: float, b: float) -> bool:
    return abs(a - b) <= 1e-9 * max(1.0, abs(a), abs(b))


def loss_error(s: dict[str, Any], serial: dict[str, Any]) -> float:
    return max(abs(a - b) / abs(b) for a, b in zip(s["losses"], serial["losses"]))


def _max(s: dict[str, Any], key: str) -> float | None:
    values = [r[key] for r in s["ranks"] if r.get(key) is not None]
    return max(values) if values else None


def _mib(v: float | None) -> str:
    return "" if v is None else f"{v / MIB:,.1f}"


def job_table(job: dict[str, Any]) -> str:
    """One Markdown table: every system of one job, with its ratios to the others of the same job."""
    ok = {s["system"]: s for s in job["systems"] if s["status"] == "ok"}
    serial = ok.get("serial")
    lines = [f"**{job['model']}** ({job['size']}), {job['world']} ranks, global batch {job['batch']}, "
             f"{job['steps']} measured steps after {job['warmup']} warm-up, {job['backend']}"
             + (f", pipelines: {job['schedule']} with {job['microbatches']} micro-batches" if any(
                 'p' in s['system'].split(':')[-1] or s['system'] == 'pipe' for s in job['systems']) else ""),
             "",
             "| system | step (ms) | predicted step (ms, share of measured) | speedup over serial | vs the same plan's peer | "
             "peak memory / rank (MiB) | parameters / rank (MiB) | sent / rank / step (MiB) | "
             f"predicted sent (MiB) | loss after {job['warmup'] + job['steps']} steps |",
             "|---|---:|---:|---:|---|---:|---:|---:|---:|---:|"]
    for s in job["systems"]:
        name = label(s["system"])
        if s["status"] != "ok":
            lines.append(f"| {name} | {s['status']}: {s['reason']} | | | | | | | | |")
            continue
        t = s["step_seconds"]
        vs_serial = f"{serial['step_seconds'] / t:.2f}x" if serial and s is not serial else ""
        peer = same_plan_peer(s["system"], job["world"])
        vs_peer = ""
        if peer in ok:
            ratio = t / ok[peer]["step_seconds"]
            vs_peer = f"{ratio:.2f}x {PEER_NAMES[peer]}'s time"
        loss = f"{s['losses'][-1]:.6f}"
        if serial and s is not serial:
            err = loss_error(s, serial)
            loss += f" ({'=' if err <= LOSS_RTOL else 'DIFFERS:'} {err:.0e})"
        predicted = _max(s, "predicted_bytes")
        ours = s["system"].startswith("autopar")
        seconds = _max(s, "predicted_seconds")
        predicted_time = (f"{seconds * 1e3:,.1f} ({seconds / t:.0%})" if seconds is not None
                          else ("n/a" if ours else ""))
        lines.append(f"| {name} | {t * 1e3:,.1f} | {predicted_time} | {vs_serial} | {vs_peer} | {_mib(_max(s, 'peak_bytes'))} | "
                     f"{_mib(_max(s, 'param_bytes'))} | {_mib(_max(s, 'comm_bytes'))} | "
                     f"{_mib(predicted) if predicted is not None else ('n/a' if ours else '')} "
                     f"| {loss} |")
    return "\n".join(lines)


def exchange_notes(job: dict[str, Any]) -> list[str]:
    """Per autopar grid that moved rows to experts on other ranks: what its all-to-alls sent per rank against the
    plan's balanced-routing prediction (the routing decides the bytes)."""
    out = []
    for s in job["systems"]:
        ranks = s.get("ranks") or []
        sent = [r.get("comm_by_kind", {}).get("all_to_all", 0.0) for r in ranks]
        if s["status"] != "ok" or not any(sent):
            continue
        predicted = max(r.get("predicted_all_to_all", 0.0) for r in ranks)
        out.append(f"{label(s['system'])}: the expert exchange (all-to-all) sent {min(sent) / 2**20:.2f}-"
                   f"{max(sent) / 2**20:.2f} MiB per rank in the last step, {predicted / 2**20:.2f} MiB predicted for "
                   f"balanced routing ({max(sent) / predicted:.2f}x at the busiest rank)" if predicted else
                   f"{label(s['system'])}: the expert exchange sent up to {max(sent) / 2**20:.2f} MiB per rank")
    return out


def ratio_table(job: dict[str, Any]) -> str:
    """autopar's step time over each peer's, every pair measured in the same job (< 1: autopar is faster)."""
    ok = {s["system"]: s for s in job["systems"] if s["status"] == "ok"}
    peers = [p for p in PEER_NAMES if p in ok]
    ours = [s for s in ok if s.startswith("autopar:")]
    if not ours or not peers:
        return ""
    lines = ["| autopar time / peer time | " + " | ".join(PEER_NAMES[p] for p in peers) + " |",
             "|---|" + "---:|" * len(peers)]
    for s in ours:
        lines.append(f"| {label(s)} | " + " | ".join(
            f"{ok[s]['step_seconds'] / ok[p]['step_seconds']:.2f}" for p in peers) + " |")
    return "\n".join(lines)


def findings(jobs: list[dict[str, Any]]) -> list[str]:
    """One line per autopar grid slower than the peer running the same plan, by any margin."""
    out = []
    for job in jobs:
        ok = {s["system"]: s for s in job["systems"] if s["status"] == "ok"}
        for name, s in ok.items():
            peer = same_plan_peer(name, job["world"])
            if peer in ok and (ratio := s["step_seconds"] / ok[peer]["step_seconds"]) > 1:
                out.append(f"{label(name)} is {ratio:.2f}x slower than {PEER_NAMES[peer]} (the same plan) on "
                           f"{job['model']} at {job['world']} ranks: {s['step_seconds'] * 1e3:.1f} ms against "
                           f"{ok[peer]['step_seconds'] * 1e3:.1f} ms per step.")
    return out


def accuracy(job: dict[str, Any]) -> dict[str, float] | None:
    """How well the plan search's step model (``passes.analysis.search_plans``, on this run's calibrated
    rates) predicts this job's autopar grids: mean absolute percentage error, Kendall's tau of the
    predicted and measured orders, and the measured time of the grid it ranks first over the fastest
    measured one. None with fewer than two predicted grids."""
    rows = [(s["step_seconds"], _max(s, "predicted_seconds")) for s in job["systems"]
            if s["status"] == "ok" and s["system"].startswith("autopar:")]
    rows = [(m, p) for m, p in rows if p is not None]
    if len(rows) < 2:
        return None
    return {**dataclasses.asdict(prediction_accuracy([p for _, p in rows], [m for m, _ in rows])), "grids": len(rows),
            "abs_errors": [abs(p - m) / m for m, p in rows]}


def accuracy_table(jobs: list[dict[str, Any]]) -> str:
    lines = ["| model | ranks | autopar grids | mean abs. % error | Kendall tau | picked grid / fastest |",
             "|---|---:|---:|---:|---:|---:|"]
    every = [a for job in jobs if (a := accuracy(job)) is not None]
    for job in jobs:
        a = accuracy(job)
        if a is not None:
            lines.append(f"| {job['model']} | {job['world']} | {a['grids']} | {a['mape']:.0%} | {a['kendall_tau']:.2f} | "
                         f"{a['picked_over_fastest']:.2f}x |")
    if len(every) > 1:  # every grid's error; tau within each job (orders across models say little); the worst pick
        errors = [e for a in every for e in a["abs_errors"]]
        lines.append(f"| every grid | | {len(errors)} | {sum(errors) / len(errors):.0%} | "
                     f"{sum(a['kendall_tau'] for a in every) / len(every):.2f} (mean) | "
                     f"{max(a['picked_over_fastest'] for a in every):.2f}x (worst) |")
    return "\n".join(lines) if len(lines) > 2 else ""


def markdown(jobs: list[dict[str, Any]], command: str, machine: str) -> str:
    parts = [f"Command: `{command}`", "", f"Machine: {machine}", ""]
    for job in jobs:
        parts += [job_table(job), "", ratio_table(job), ""]
        notes = exchange_notes(job)
        parts += [f"- {n}" for n in notes] + ([""] if notes else [])
    table = accuracy_table(jobs)
    if table:
        parts += ["The plan search's step model against the measured autopar grids (predictions on this run's "
                  "calibrated rates):", "", table, ""]
    slow = findings(jobs)
    parts += ["Where autopar is slower than the peer with the same plan:", ""]
    parts += [f"- {line}" for line in slow] or ["- nowhere in this run."]
    problems = [p for job in jobs for p in checks(job)]
    parts += ["", "Checks (losses equal serial's; bytes equal autopar's count and the trace's prediction, the "
              "experts' all-to-alls aside): "
              + ("all hold." if not problems else f"{len(problems)} failed:"), ""]
    parts += [f"- {p}" for p in problems]
    return "\n".join(parts).rstrip() + "\n"


def plots(jobs: list[dict[str, Any]], out: Path) -> list[Path]:
    """step_time.png and memory.png: one panel per job, one bar per system. [] without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log.warning("benchmarks: matplotlib is not installed, so no plots (pip install -e '.[bench]')")
        return []
    written = []
    for name, title, series in (
            ("step_time.png", "median step time (ms)", [("step", lambda s: s["step_seconds"] * 1e3)]),
            ("memory.png", "per rank, max over ranks (MiB)",
             [("peak memory", lambda s: (_max(s, "peak_bytes") or 0) / MIB),
              ("parameters", lambda s: _max(s, "param_bytes") / MIB)])):
        fig, axes = plt.subplots(1, len(jobs), figsize=(5.5 * len(jobs), 4.2), squeeze=False)
        for ax, job in zip(axes[0], jobs):
            ok = [s for s in job["systems"] if s["status"] == "ok"]
            width = 0.8 / len(series)
            for k, (what, value) in enumerate(series):
                xs = [i + (k - (len(series) - 1) / 2) * width for i in range(len(ok))]
                ax.bar(xs, [value(s) for s in ok], width, label=what,
                       color=["tab:orange" if s["system"].startswith("autopar") else "tab:blue" for s in ok]
                       if len(series) == 1 else None)
            ax.set_xticks(range(len(ok)), [label(s["system"]) for s in ok], rotation=45, ha="right", fontsize=8)
            ax.set_title(f"{job['model']} ({job['size']}), {job['world']} ranks", fontsize=10)
            ax.set_ylabel(title)
            if len(series) > 1:
                ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(out / name, dpi=110)
        plt.close(fig)
        written.append(out / name)
    return written
