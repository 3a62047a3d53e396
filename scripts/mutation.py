"""Mutation testing of ddplab's core modules with cosmic-ray: `make mutation` (all) or
`make mutation MODULES="train/data.py train/metrics.py"`.

Each module is mutated in a copy of the repository (the working tree is never touched), one
mutant at a time, and its own fast subset of tests runs against each mutant. cosmic-ray mutates
the files on disk, so tests that start real `ddplab` processes see the mutant too. Prints each
module's score (killed / all) and the surviving mutants; docs/testing.md records the results.
"""

import argparse
import json
import os
import shutil
import sqlite3
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# each module's last results (git ignores it)
KEPT = REPO / ".mutation"
# module (under src/ddplab) -> the tests that must kill its mutants (pytest arguments)
SUBSETS = {
    "train/data.py": [
        "tests/train/test_data_order.py",
        "tests/train/test_loop_reference.py",
        "tests/train/test_batch_plan.py",
        "-k",
        "(not loop_reference or dataset or cannot_take_a_step) and not replans and not before_any_worker",
    ],
    "train/metrics.py": ["tests/train/test_metrics.py", "-k", "not logged_lines"],
    "train/nonfinite.py": ["tests/train/test_metrics.py", "-k", "guard or skip_mode or gradients_finite"],
    "checkpoint/store.py": [
        "tests/checkpoint/test_checkpoints.py::test_keep_last_and_keep_best_pruning",
        "tests/checkpoint/test_checkpoints.py::test_only_committed_checkpoints_with_readable_meta_are_listed_"
        "and_a_run_resolves_to_its_last",
        "tests/checkpoint/test_checkpoints.py::test_an_async_save_holds_the_values_of_when_it_was_called",
        "tests/checkpoint/test_checkpoints.py::test_saving_a_step_again_replaces_it_whole",
        "tests/train/test_loop_reference.py",
        "tests/checkpoint/test_checkpoints.py::test_checkpoints_load_with_weights_only_and_reject_pickled_code",
        "tests/checkpoint/test_real_faults.py::test_a_file_size_limit_stops_the_run_in_one_line",
    ],
    "config.py": [
        "tests/test_config.py",
        "tests/test_settings.py",
        "-k",
        "not never_reaches",
        "tests/test_show_config_and_plan.py::test_show_config_lists_every_setting_with_type_value_default_and_help",
    ],
    "train/step.py": ["tests/train/test_loop_reference.py"],
    "train/loop.py": ["tests/train/test_loop_reference.py"],
    "train/intervals.py": [
        "tests/train/test_log_interval.py",
        "tests/train/test_loop_reference.py",
        "tests/train/test_metrics.py",
        "-k",
        "not logged_lines",
    ],
    "checkpoint/state.py": [
        "tests/train/test_loop_reference.py",
        "tests/checkpoint/test_checkpoints.py::test_resume_on_another_world_size_sees_the_same_batches",
    ],
    # the capabilities of the latest round: sweeps, the slow rank named, DDP's communication hooks
    "launch/space.py": ["tests/launch/test_sweep_parts.py", "tests/launch/test_sweeps.py", "-m", "not slow"],
    "train/pruning.py": ["tests/launch/test_sweep_parts.py"],
    # the command's checks and planning; its trials are run by the slow tests of test_sweeps.py
    "launch/sweep.py": [
        "tests/launch/test_sweep_parts.py",
        "tests/launch/test_sweeps.py::test_a_malformed_sweep_is_one_line_before_anything_starts",
    ],
    "launch/trials.py": ["tests/launch/test_trial_runs.py"],
    "launch/elastic.py": ["tests/launch/test_elastic_parts.py"],
    "train/oom.py": ["tests/train/test_oom_parts.py"],
    "train/early_stop.py": [
        "tests/train/test_early_stop.py",
        "tests/train/test_monitor_modes.py",
        "tests/train/test_nonfinite_monitor.py",
    ],
    "train/capability.py": ["tests/train/test_capability.py"],
    "train/ema.py": ["tests/train/test_ema.py", "-m", "not slow"],
    "train/profiling.py": ["tests/train/test_profiling_parts.py"],
    "tools/sweeps.py": ["tests/tools/test_sweep_listing.py"],
    "train/trackers.py": ["tests/train/test_mlflow_parts.py"],
    "train/stragglers.py": [
        "tests/train/test_stragglers.py",
        "-m",
        "not slow",
        "-k",
        "not dataset_is_slow and not slow_in",
    ],
    "distributed/sharding.py": ["tests/distributed/test_sharding_parts.py"],
    "distributed/powersgd.py": ["tests/distributed/test_powersgd_parts.py"],
    "distributed/comm_hooks.py": [
        "tests/distributed/test_scaling.py",
        "-k",
        "compression_changes or levers_that_cannot_run or powersgd_state_is_saved",
    ],
}
CONFIG = """[cosmic-ray]
module-path = "src/ddplab/{module}"
timeout = {timeout}
excluded-modules = []
test-command = "{python} -m pytest -x -q -p no:cacheprovider -p no:randomly {tests}"

[cosmic-ray.distributor]
name = "local"
"""


def run_module(
    module: str, work: Path, timeout: float, recheck: Path | None = None, lines: tuple[int, int] | None = None
) -> dict:
    """Mutate `module` in the copy `work`. With `recheck` (a database of an earlier run of the same
    module source), only the mutants that survived it, or were not run, are tried again: after
    tests were added for them, without spending the hour a whole module can take. With `lines`
    (first, last), only the mutants on those lines are made."""
    tests = " ".join(f"'{t}'" if " " in t else t for t in SUBSETS[module])
    config = work / "cr.toml"
    config.write_text(CONFIG.format(module=module, timeout=timeout, python=sys.executable, tests=tests))
    db = work / f"{module.replace('/', '_')}.sqlite"
    env = {**os.environ, "PYTHONPATH": str(work / "src")}
    steps = [["cosmic-ray", "exec", str(config), str(db)]]
    if recheck is None:
        steps.insert(0, ["cosmic-ray", "init", str(config), str(db)])
    else:
        shutil.copy(recheck, db)
        with sqlite3.connect(db) as con:
            con.execute("DELETE FROM work_results WHERE test_outcome = 'SURVIVED'")
    for step in steps:
        subprocess.run([str(Path(sys.executable).parent / step[0]), *step[1:]], cwd=work, env=env, check=True)
        if step[1] == "init" and lines:
            _keep_lines(db, *lines)
    KEPT.mkdir(exist_ok=True)
    # for a later --recheck
    shutil.copy(db, KEPT / db.name)
    dump = subprocess.run(
        [str(Path(sys.executable).parent / "cosmic-ray"), "dump", str(db)],
        cwd=work,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    jobs = [json.loads(line) for line in dump.splitlines() if line.strip()]
    survived = [job for job, result in jobs if result and result.get("test_outcome") == "survived"]
    done = [result for _, result in jobs if result]
    source = (work / "src" / "ddplab" / module).read_text().splitlines()
    return {
        "module": module,
        "mutants": len(done),
        "killed": len(done) - len(survived),
        "survivors": [
            f"line {m['start_pos'][0]} {m['operator_name'].split('/')[-1]} #{m['occurrence']}: "
            f"{source[m['start_pos'][0] - 1].strip()}"
            for job in survived
            for m in job["mutations"]
        ],
    }


def _keep_lines(db: Path, first: int, last: int) -> None:
    """Drop the mutants cosmic-ray planned outside lines first..last of the module."""
    with sqlite3.connect(db) as con:
        outside = "SELECT job_id FROM mutation_specs WHERE start_pos_row NOT BETWEEN ? AND ?"
        con.execute(f"DELETE FROM work_items WHERE job_id IN ({outside})", (first, last))
        con.execute("DELETE FROM mutation_specs WHERE start_pos_row NOT BETWEEN ? AND ?", (first, last))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("modules", nargs="*", default=list(SUBSETS))
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds per mutant's test run")
    parser.add_argument(
        "--lines",
        help="START-END: only the mutants on these lines of the module (one function of a large module)",
    )
    parser.add_argument(
        "--recheck",
        action="store_true",
        help="try again only the survivors of the last run (.mutation/), e.g. after adding tests",
    )
    args = parser.parse_args()
    failed = False
    for module in args.modules:
        with tempfile.TemporaryDirectory() as tmp:
            work = Path(tmp) / "repo"
            shutil.copytree(
                REPO, work, ignore=shutil.ignore_patterns(".venv", ".git", "runs", "__pycache__", ".mutation")
            )
            kept = KEPT / f"{module.replace('/', '_')}.sqlite"
            lines = tuple(int(n) for n in args.lines.split("-")) if args.lines else None
            result = run_module(module, work, args.timeout, kept if args.recheck else None, lines)
        score = result["killed"] / max(result["mutants"], 1)
        failed |= score < 0.85
        print(f"{module}: {result['killed']} of {result['mutants']} mutants killed ({score:.0%})", flush=True)
        for survivor in result["survivors"]:
            print(f"  survived: {survivor}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
