"""Write docs/benchmarks.md and docs/img/benchmarks.png from benchmarks/results/*.json.

Tables give medians, the spread (min..max over the rounds) and the ratio to the baseline; each
goal is marked met or missed from the numbers themselves. NOTES.md beside this file holds the
explanations, which are written by hand after reading the numbers and go in verbatim.
"""

from __future__ import annotations

import json
from pathlib import Path

from common import REPO, RESULTS

DOC, CHART = REPO / "docs" / "benchmarks.md", REPO / "docs" / "img" / "benchmarks.png"
NAMES = {
    "raw": "raw DDP loop",
    "handwritten": "hand-written GPT script (nanoGPT's way)",
    "script": "the GPT script's step (nanoGPT's way)",
    "ddplab": "ddplab Experiment",
    "fabric": "Lightning Fabric",
    "trainer": "Lightning Trainer",
    "accelerate": "Accelerate",
}


def load(name: str) -> dict | None:
    path = RESULTS / f"{name}.json"
    return json.loads(path.read_text()) if path.exists() else None


def fmt(seconds: float) -> str:
    return f"{seconds * 1e3:.2f} ms" if seconds < 1 else f"{seconds:.2f} s"


def rows(table: dict, names: dict | None = None) -> list[str]:
    out = []
    for key, r in table.items():
        ratio = f"{r['ratio']:.3f}×" if "ratio" in r else ""
        out.append(
            f"| {(names or {}).get(key, key)} | {fmt(r['median'])} | {fmt(r['min'])} – {fmt(r['max'])} | {ratio} |"
        )
    return out


def goal(ok: bool) -> str:
    return "**met**" if ok else "**missed**"


def steps_section(data: dict, inprocess: dict | None = None) -> list[str]:
    lines = [
        "## Step overhead (2 gloo ranks, CPU)",
        "",
        "Separate runs, interleaved: every contender is a fresh pair of processes in each round.",
        "",
    ]
    for workload, res in data["results"].items():
        t = res["per_step_s"]
        # the frameworks ddplab is ranked among (the raw loop and a hand-written script are not)
        others = [t[k]["ratio"] for k in t if k in ("fabric", "trainer", "accelerate")]
        lowest = all(t["ddplab"]["ratio"] < r for r in others)
        same = (inprocess or {}).get("results", {}).get(workload)
        overhead = same["ddplab"]["paired"]["median"] if same else t["ddplab"]["ratio"]
        where = "in the same processes, below" if same else "here"
        p = res["raw_vs_ddplab_parameters"]
        lines += [
            f"### {workload} (global batch {res['global_batch']}, {res.get('rounds', data.get('rounds'))} rounds)",
            "",
            "| contender | time per step (median) | spread (min – max) | ratio to raw |",
            "| --- | --- | --- | --- |",
            *rows(t, NAMES),
            "",
            f"Goal ≤ 1.02× raw ({where}: {overhead:.3f}×): {goal(overhead <= 1.02)}. Lowest ratio among the "
            f"frameworks: {goal(lowest)}. Final parameters of the raw loop and ddplab: "
            f"{'bitwise equal' if p['bitwise_equal'] else 'max abs difference ' + format(p['max_abs_diff'], '.3g')}.",
            "",
        ]
        lines += _against_the_script(t, res.get("rss_mib", {}))
        lines += _where_time_goes(res.get("where_time_goes", {}))
    return lines


def _where_time_goes(split: dict) -> list[str]:
    """Each contender's step split by torch.profiler's record of rank 0 (where_time_goes.py)."""
    if not split:
        return []
    lines = [
        "Where the step goes (one profiled run each, rank 0, ms per step under the profiler; "
        "`bench_steps.py --profile`, categories in `benchmarks/where_time_goes.py`):",
        "",
        "| contender | step | data | compute | communication (exposed) | host |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for name, r in split.items():
        cells = " | ".join(f"{r[k]:.2f}" for k in ("step", "data", "compute", "communication", "host"))
        lines.append(f"| {NAMES.get(name, name)} | {cells} |")
    return [*lines, ""]


def _against_the_script(t: dict, rss: dict) -> list[str]:
    """A workload raced by a script written as such scripts are: time and memory beside it."""
    if "handwritten" not in t or not rss:
        return []
    base = t["handwritten"]["median"]
    lines = [
        "| contender | time per step / the script's | peak resident memory, rank 0 | / the script's |",
        "| --- | --- | --- | --- |",
    ]
    for name, r in t.items():
        if name in rss:
            lines.append(
                f"| {NAMES.get(name, name)} | {r['median'] / base:.3f}× | {rss[name]:.0f} MiB "
                f"| {rss[name] / rss['handwritten']:.3f}× |"
            )
    time_ok = t["ddplab"]["median"] / base <= 1.02
    memory_ok = rss["ddplab"] / rss["handwritten"] <= 1.05
    lines += [
        "",
        f"Goals beside the hand-written script: time ≤ 1.02× {goal(time_ok)}, memory ≤ 1.05× {goal(memory_ok)}.",
        "",
    ]
    return lines


def inprocess_section(data: dict) -> list[str]:
    lines = [
        "## Step overhead in the same processes",
        "",
        "One pair of gloo ranks runs, round after round, a block of steps of the raw loop, of a second copy of "
        "it (the control) and of ddplab's loop (for gpt also of the GPT script's step), on the same DDP model "
        "and optimizer (`benchmarks/bench_inprocess.py`), in several launches, pooled. The ratio is the median "
        "of each round's ratio to its raw block, with a bootstrap 95 % interval; the control shows how far an "
        "identical loop reads.",
        "",
        "| workload | blocks | loop | time per step (median) | ratio to raw (paired) | 95 % interval | per launch |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for workload, t in data["results"].items():
        setup = t.get("setup", data)
        blocks = f"{setup['rounds']} rounds × {setup['launches']}, {setup['block_steps']} steps"
        for key, r in t.items():
            if key == "setup":
                continue
            pr = r.get("paired")
            cells = (
                [
                    f"{pr['median']:.3f}×",
                    f"{pr['low']:.3f} – {pr['high']:.3f}",
                    ", ".join(f"{x:.3f}" for x in pr.get("per_launch", [])),
                ]
                if pr
                else ["", "", ""]
            )
            if key == "ddplab_vs_script":
                continue
            name = {"raw_control": "raw DDP loop, second copy"}.get(key, NAMES.get(key, key))
            lines.append(f"| {workload} | {blocks} | {name} | {fmt(r['median'])} | " + " | ".join(cells) + " |")
    for workload, t in data["results"].items():
        if "ddplab_vs_script" in t:
            r = t["ddplab_vs_script"]
            lines += [
                "",
                f"{workload}: ddplab's loop / the script's, block by block: {r['median']:.3f}× (95 % interval "
                f"{r['low']:.3f} – {r['high']:.3f}); goal ≤ 1.02×: {goal(r['median'] <= 1.02)}.",
            ]
    return [*lines, ""]


def startup_section(data: dict) -> list[str]:
    imp, first = data["imports"], data["time_to_first_step"]
    full = imp["import ddplab; ddplab.Experiment"]["ratio"]
    return [
        "## Import and start-up",
        "",
        "| what | wall time (median) | spread | ratio to `import torch` |",
        "| --- | --- | --- | --- |",
        *rows({f"`{k}`": v for k, v in imp.items()}),
        "",
        f"Goal `import ddplab` ≤ 1.05× `import torch`: {goal(imp['import ddplab']['ratio'] <= 1.05)} "
        f"(with the Experiment class loaded: {full:.3f}×).",
        "",
        "| command (mlp, 2 processes) | time to first step | spread | ratio |",
        "| --- | --- | --- | --- |",
        *rows({"`torchrun` raw loop": first["raw"], "`ddplab run -n 2`": first["ddplab"]}),
        "",
    ]


def checkpoint_section(data: dict) -> list[str]:
    s = data["blocked_per_save"]
    ratio = s["ddplab async"]["median"] / s["ddplab sync"]["median"]
    return [
        "## Checkpoints",
        "",
        f"State: {data['state_bytes'] / 1e6:.1f} MB (BBBP model, AdamW state, RNG states).",
        "",
        "| save | training blocked (median) | spread | ratio to ddplab sync |",
        "| --- | --- | --- | --- |",
        *rows(s),
        "",
        f"Goal async stall ≤ 0.2× sync: {goal(ratio <= 0.2)} ({ratio:.3f}×).",
        "",
        "| load | time (median) | spread | ratio to torch.load |",
        "| --- | --- | --- | --- |",
        *rows(data["load"]),
        "",
    ]


def object_storage_section(data: dict) -> list[str]:
    s, steps = data["blocked_per_save"], data["step_during_async_save"]
    return [
        "## Checkpoints in object storage",
        "",
        f"State: {data['state_bytes'] / 1e6:.0f} MB. The bucket is moto's S3-compatible server in its own process "
        "on 127.0.0.1 (`bench_object_storage.py`): on these 2 cores it competes with the benchmark for the CPU, "
        "so the bucket's figures are upper bounds for a store on another machine.",
        "",
        "| save of one checkpoint | caller blocked (median) | spread | ratio to the local disk |",
        "| --- | --- | --- | --- |",
        *rows(s),
        "",
        "| load | time (median) | spread | ratio to the local disk |",
        "| --- | --- | --- | --- |",
        *rows(data["load"]),
        "",
        "| training step (small MLP, CPU) | time (median) | spread | ratio to no save |",
        "| --- | --- | --- | --- |",
        *rows(steps),
        "",
    ]


def fsdp_section(data: dict) -> list[str]:
    def per_rank(values: list) -> str:
        return " / ".join(f"{v:g}" for v in values)

    lines = [
        "## Sharded training (FSDP)",
        "",
        f"What each rank holds when its optimizer steps ({data['workload']}, `bench_fsdp.py`): weights, "
        "gradients and optimizer state in MiB, and the rank's peak resident memory (the whole process: "
        "torch itself is about 0.3 GiB).",
        "",
        "| ranks | strategy | weights + gradients + optimizer state (MiB per rank) | of which optimizer "
        "| resident (GiB) |",
        "| --- | --- | --- | --- | --- |",
    ]
    for row in data["memory"]:
        lines.append(
            f"| {row['ranks']} | {row['strategy']} | {per_rank(row['state_mib'])} | {per_rank(row['optimizer_mib'])} "
            f"| {per_rank([round(v, 2) for v in row['resident_gib']])} |"
        )
    worst = max(data["goal"].values())
    lines += [
        "",
        f"Goal FSDP's state per rank ≤ 1.1 / W of DDP's: {goal(worst <= 1.1)} "
        f"({', '.join(f'{r}: {w}×' for r, w in data['goal'].items())} of DDP's / W).",
        "",
        "| 2 ranks, CPU | time per step (median) | spread | ratio to DDP |",
        "| --- | --- | --- | --- |",
        *rows(data["step_s"]),
        "",
    ]
    return lines


def live_section(data: dict) -> list[str]:
    f = data["failure"]
    steps = data["steps"]
    lines = [
        "## Live recovery",
        "",
        f"A process lost and what it costs ({data['workload']}; a 0.1 s step, 60 steps; process 1 SIGKILLed "
        f"inside its backward of step {data['kill_step']}, while its peer waits in the all_reduce; "
        "`bench_live.py`). Live: `dist.fault_tolerance=live`, the replacement heals from the peer. Restart: "
        "`--max-restarts 1`, a checkpoint every 10 steps. The cost is the run's wall time beside the same "
        "run without the kill.",
        "",
        "| path | uninterrupted run | with the kill | ratio | cost of the failure | steps trained again |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for mode, r in f.items():
        redone = ", ".join(map(str, r["steps_redone"]))
        lines.append(
            f"| {mode} | {fmt(r['uninterrupted']['median'])} | {fmt(r['killed']['median'])} "
            f"| {r['killed']['ratio']:.3f}× | {fmt(r['cost_s'])} | {redone} |"
        )
    live, restart = f["live"], f["restart"]
    ok = max(live["steps_redone"]) <= 1 and live["cost_s"] < 5
    lines += [
        "",
        f"Goal a failure costs at most one step and a few seconds: {goal(ok)} (live: "
        f"{max(live['steps_redone'])} step(s), {live['cost_s']:.1f} s; the restart path: "
        f"{max(restart['steps_redone'])} steps, {restart['cost_s']:.1f} s).",
        "",
        "When nothing fails (the same model without the sleep, a step of about a millisecond, where the "
        "quorum's round trips weigh most; 300 steps, 2 processes):",
        "",
        "| contender | time per step (median) | spread | ratio to DDP |",
        "| --- | --- | --- | --- |",
        *rows(steps, {"ddp": "DDP (2 ranks)", "live": "live recovery (2 replicas)"}),
        "",
        f"Per step, live recovery adds {fmt(steps['live']['median'] - steps['ddp']['median'])}: torchft's "
        "quorum (a round trip to the lighthouse before the forward), its commit vote after the backward, "
        "the loss summed over the quorum, and DDP with `find_unused_parameters` (torchft keeps the "
        "buckets from being rebuilt, so a healed replica's match its peers').",
        "",
    ]
    return lines


def resume_section(data: dict) -> list[str]:
    t = data["time_to_first_step"]
    flat = max(r["ratio"] for r in t.values()) <= 1.1
    return [
        "## Resume cost",
        "",
        f"Time from the command to the first step after resuming ({data['steps_per_epoch']} "
        "steps per epoch, one process).",
        "",
        "| position in the epoch | time to first step | spread | ratio to 0 % |",
        "| --- | --- | --- | --- |",
        *rows(t),
        "",
        f"Goal flat (O(1); here: every ratio ≤ 1.1): {goal(flat)}.",
        "",
    ]


def data_resume_section(data: dict) -> list[str]:
    position, stream = data["by_position"], data["stream"]
    ratio = position["by position, 90 %"]["ratio"]
    return [
        "## Resuming mid-epoch on sharded data",
        "",
        f"Time to the first batch when a loader starts at step 0 and at step {data['resume_step']} (90 %) of an "
        f"epoch of {data['steps_per_epoch']} steps, {data['samples']:,} samples in webdataset shards, in process.",
        "",
        "| read | time to first batch | spread | ratio to 0 % |",
        "| --- | --- | --- | --- |",
        *rows(position),
        *rows(stream),
        "",
        f"Goal by position flat (here: ratio ≤ 1.5): {goal(ratio <= 1.5)} ({ratio:.2f}×); a stream without a "
        f"state_dict replays to its step: {stream['stream, 90 %']['ratio']:.1f}×.",
        "",
    ]


def metrics_section(data: dict) -> list[str]:
    c = data["collectives_per_logged_step"]
    return [
        "## Metric aggregation (alignment_stats workload, 2 ranks)",
        "",
        "| approach | time per step | spread | ratio to seed 000 | metric collectives per logged step |",
        "| --- | --- | --- | --- | --- |",
        *[f"{r} {c[k]:.0f} |" for k, r in zip(data["per_step_s"], rows(data["per_step_s"]), strict=True)],
        "",
    ]


def scaling_section(data: dict) -> list[str]:
    lines = [
        "## Scaling (CPU, gloo)",
        "",
        "| workload | contender | ranks | samples/s (median) | efficiency |",
        "| --- | --- | --- | --- | --- |",
    ]
    for workload, res in data["results"].items():
        for row in res.values():
            sps = sorted(row["samples_per_s"])[len(row["samples_per_s"]) // 2]
            lines.append(
                f"| {workload} | {NAMES[row['contender']]} | {row['ranks']} | {sps:,.0f} | {row['efficiency']:.2f} |"
            )
    return [*lines, ""]


def comm_hooks_section(data: dict) -> list[str]:
    lines = [
        "## Gradient compression over a slow link",
        "",
        f"Two nodes in network namespaces, one rank each, joined by a veth pair that tc's tbf qdisc limits "
        f"each way (`make bench-levers`, root only); {data['workload']}. Step: the median step after start-up "
        f"(ddplab from its own log, the median of {data.get('rounds', 1)} interleaved runs, each run's in "
        "brackets; Lightning and Accelerate timed around each step, one run). Sent: the bytes node 0 "
        "sent per step (its link's counter; two runs of different lengths, subtracted). Lightning registers "
        "communication hooks only on GPUs, so its CPU runs are uncompressed whatever the hook.",
        "",
        "| link | hook | ddplab step | sent per step | eval loss | Lightning step | Accelerate step |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for row in data["hooks"]:
        contenders = []
        for key in ("lightning_step_ms", "accelerate_step_ms"):
            value = row[key]
            contenders.append(f"{value} ms" if isinstance(value, (int, float)) else value.split(":")[0])
        lines.append(
            f"| {row['rate']} | {row['hook']} | {row['step_ms']} ms{_rounds(row)} | {row['sent_mb_per_step']} MiB | "
            f"{row['eval_loss']} | {contenders[0]} | {contenders[1]} |"
        )
    lines += _compression_goals(data["hooks"])
    lines += [
        "",
        "## Optimizer-state sharding",
        "",
        f"Adam's state each rank holds after 4 steps ({data['memory_workload']}), `dist.shard_optimizer=true` "
        "against the default, on one machine.",
        "",
        "| ranks | sharded | MiB per rank |",
        "| --- | --- | --- |",
    ]
    for row in data["zero"]:
        held = " / ".join(f"{mb:g}" for mb in row["state_mb_per_rank"])
        lines.append(f"| {row['ranks']} | {'yes' if row['sharded'] else 'no'} | {held} |")
    return [*lines, ""]


def _rounds(row: dict) -> str:
    runs = row.get("step_ms_rounds", [])
    return f" ({', '.join(f'{v:g}' for v in runs)})" if len(runs) > 1 else ""


def _compression_goals(hooks: list[dict]) -> list[str]:
    """At 1 Gbit/s: fp16 against half the uncompressed step and against that step less the link time of
    the bytes fp16 saves (the part of the step that is not the link does not halve); PowerSGD against
    the step the faster link gives without compression (its communication mostly hidden)."""
    rows = {(r["rate"], r["hook"]): r for r in hooks}
    if not {("1gbit", "none"), ("1gbit", "fp16"), ("1gbit", "powersgd"), ("10gbit", "none")} <= rows.keys():
        return []
    none, fp16 = rows["1gbit", "none"], rows["1gbit", "fp16"]
    half = none["step_ms"] / 2
    # 1 Gbit/s carries a MiB in 8.39 ms
    saved_ms = (none["sent_mb_per_step"] - fp16["sent_mb_per_step"]) * 2**20 * 8 / 1e6
    floor = none["step_ms"] - saved_ms
    powersgd, compute = rows["1gbit", "powersgd"]["step_ms"], rows["10gbit", "none"]["step_ms"]
    lines = [
        "",
        f"At 1 Gbit/s: fp16 {fp16['step_ms'] / half:.3f}× half the uncompressed step ({half:.1f} ms; goal ≤ 1.15×: "
        f"{goal(fp16['step_ms'] / half <= 1.15)}) and {fp16['step_ms'] / floor:.3f}× the uncompressed step less "
        f"the link time of the bytes it saves ({floor:.1f} ms)",
    ]
    if small := rows.get(("1gbit", "fp16, 2 MiB buckets")):
        lines[-1] += f"; with 2 MiB buckets {small['step_ms'] / half:.3f}× half the uncompressed step"
    lines[-1] += (
        f". PowerSGD {powersgd / compute:.2f}× the step without compression at 10 Gbit/s ({compute} ms; "
        f"goal ≤ 1.3×: {goal(powersgd / compute <= 1.3)})."
    )
    return lines


def gpu_check_section(data: dict | None) -> list[str]:
    """The one-round figures `make gpu-check` brought back (benchmarks/results/gpu-check.json): a first
    reading of the GPU path, not the interleaved rounds `make bench-gpu` takes."""
    if data is None:
        return []
    lines = [
        f"First figures, {data['device']}, torch {data['torch']} (CUDA {data['cuda']}), {data['date']}: "
        f"{data['method']}. Step time per contender, ratio to the raw loop in brackets.",
        "",
        "| workload | lease | raw loop | ddplab | Lightning Fabric | Accelerate |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for row in data["step"]:
        cells = [
            f"{row[c + '_ms']:.3f} ms ({row[c + '_ms'] / row['raw_ms']:.3f}×)" if c + "_ms" in row else "not reached"
            for c in ("raw", "ddplab", "fabric", "accelerate")
        ]
        lines.append(f"| {row['what']} | {row['lease']} | {' | '.join(cells)} |")
    # what a lease's rows need beside them (another device, what was checked on the CPU)
    for note in data.get("notes", []):
        lines += ["", note]
    lines += [
        "",
        "Determinism (`trainer.deterministic=true`; largest difference of any weight): "
        + "; ".join(
            f"{r['what']} (lease {r['lease']}): twice {r['twice_max_diff']:g}, "
            f"killed and resumed {r['killed_resumed_max_diff']:g}, "
            f"twice with determinism off {r['off_twice_max_diff']:.2g}"
            for r in data["determinism"]
        )
        + ".",
        "",
    ]
    return lines


def gpu_section(data: dict | None) -> list[str]:
    """`make bench-gpu` on one GPU (benchmarks/bench_gpu.py); until then, a line that says it is unmeasured."""
    lines = ["## One GPU (`make bench-gpu`)", ""]
    if data is None:
        return [
            *lines,
            "Not measured yet: `make bench-gpu` on a machine with a CUDA GPU writes "
            "`benchmarks/results/gpu.json` and this section (`make gpu-check` measures a round of each, "
            "the GPT workload included). Goal: ddplab's step ≤ 1.01× the raw loop's on the small and the "
            "wide MLP and the GPT, fp32 and bf16.",
            "",
            *gpu_check_section(load("gpu-check")),
        ]
    m = data["machine"]
    lines += [
        f"{data['device']}, CUDA {data['cuda']}, torch {m['torch']}, {m['date']}; {data['rounds']} interleaved "
        "rounds, each contender a fresh process; step time is the median over rounds (spread min – max).",
        "",
    ]
    worst = []
    for name, table in data["results"].items():
        if name == "translation":
            continue
        lines += [
            f"### {name}",
            "",
            "| contender | time per step | spread | ratio to raw | samples/s | peak GPU memory |"
            " first step (incl. compile) |",
            "| --- | --- | --- | --- | --- | --- | --- |",
        ]
        for c, r in table.items():
            if r.get("failed"):
                lines.append(f"| {NAMES.get(c, c)} | failed | | | | | |")
                continue
            lines.append(
                f"| {NAMES.get(c, c)} | {r['step_ms']:.3f} ms | {r['min_ms']:.3f} – {r['max_ms']:.3f} ms | "
                f"{r['ratio_to_raw']:.3f}× | {r['samples_per_s']:.0f} | {r['peak_mem_gib'] or 0:.2f} GiB | "
                f"{r['first_step_s']:.1f} s |"
            )
        if "ddplab" in table and table["ddplab"].get("ratio_to_raw") and "/eager" in name:
            worst.append((table["ddplab"]["ratio_to_raw"], name))
        lines.append("")
    if worst:
        ratio, name = max(worst)
        lines += [f"Goal ≤ 1.01× raw without compile (worst: {ratio:.3f}×, {name}): {goal(ratio <= 1.01)}.", ""]
    if t := data["results"].get("translation"):
        lines += [
            "### Translation transformer, trainer.compile (bf16)",
            "",
            f"{t['eager']['samples_per_s']:.0f} samples/s eager, {t['compiled']['samples_per_s']:.0f} compiled "
            f"({t['speedup']:.2f}×); the first log interval, which compiles: "
            f"{t['compiled']['first_interval_samples_per_s']:.0f} samples/s compiled vs "
            f"{t['eager']['first_interval_samples_per_s']:.0f} eager.",
            "",
        ]
    return lines


def chart(steps: dict | None) -> bool:
    if not steps:
        return False
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    workloads = list(steps["results"])
    fig, axes = plt.subplots(1, len(workloads), figsize=(5.5 * len(workloads), 3.6), squeeze=False)
    for ax, workload in zip(axes[0], workloads, strict=False):
        t = steps["results"][workload]["per_step_s"]
        names = list(t)
        ax.bar(
            [NAMES[n] for n in names],
            [t[n]["ratio"] for n in names],
            color=["C7" if n == "raw" else "C0" if n == "ddplab" else "C1" for n in names],
        )
        ax.axhline(1.0, color="k", linewidth=0.8)
        ax.set_title(f"{workload}: time per step relative to the raw DDP loop")
        ax.set_ylabel("ratio (lower is better)")
        ax.tick_params(axis="x", rotation=25, labelsize=8)
    fig.tight_layout()
    CHART.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(CHART, dpi=110)
    return True


def main() -> None:
    parts = {
        "steps": steps_section,
        "inprocess": inprocess_section,
        "startup": startup_section,
        "checkpoint": checkpoint_section,
        "object_storage": object_storage_section,
        "fsdp": fsdp_section,
        "live": live_section,
        "resume": resume_section,
        "data_resume": data_resume_section,
        "metrics": metrics_section,
        "scaling": scaling_section,
        "comm_hooks": comm_hooks_section,
    }
    loaded = {k: load(k) for k in parts}
    machine = next((d["machine"] for d in loaded.values() if d), {})
    notes = Path(__file__).parent / "NOTES.md"
    lines = [
        "# Benchmarks",
        "",
        "Measured side by side in one run: each round runs every contender once, in a rotating order, and "
        "the tables compare medians as ratios to a baseline. Absolute times are context only: this is a "
        "shared, noisy machine.",
        "",
        f"Machine: {machine.get('cpu', '?')}, {machine.get('cores', '?')} cores, "
        f"{machine.get('gpu') or 'no GPU'}; Python {machine.get('python', '?')}, torch "
        f"{machine.get('torch', '?')}; {machine.get('date', '')}.",
        "",
        "Reproduce: `make bench` (installs Lightning and Accelerate, the `bench` extra, then runs every script in "
        "`benchmarks/` and rewrites this page). Raw results: `benchmarks/results/*.json`.",
        "",
    ]
    if chart(loaded["steps"]):
        lines += ["![time per step relative to the raw loop](img/benchmarks.png)", ""]
    if notes.exists():
        lines += [notes.read_text().strip(), ""]
    for key, section in parts.items():
        if loaded[key]:
            lines += section(loaded[key], loaded["inprocess"]) if key == "steps" else section(loaded[key])
    lines += gpu_section(load("gpu"))
    DOC.write_text("\n".join(lines))
    print(f"wrote {DOC.relative_to(REPO)}")


if __name__ == "__main__":
    main()
