"""`ddplab report` on synthetic run directories: panels, PNG files, summary, a run still writing."""

import json
from pathlib import Path

import matplotlib
import matplotlib.pyplot as plt
import pytest

from ddplab.launch.cli import main
from ddplab.tools.report import _plot_panel, draw, load_run, panels_for

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _fake_run(path, steps=30, eval_every=10, offset=0.0, partial_line=True):
    path.mkdir(parents=True)
    rows = []
    for s in range(5, steps + 1, 5):
        rows.append(
            {
                "step": s,
                "time": 1000.0 + s,
                "train/loss": 2.0 / s + offset,
                "train/lr": 1e-3 * min(1, s / 10),
                "train/samples_per_s": 500.0 + s,
                "train/epoch": s / 10,
                "train/grad_norm": 1.0 + offset,
            }
        )
        if s % eval_every == 0:
            rows.append({"step": s, "time": 1000.5 + s, "eval/loss": 1.5 / s, "eval/accuracy": 0.5 + s / 100 + offset})
    rows.append({"step": steps, "time": 1100.0, "heldout/accuracy": 0.8})
    text = "".join(json.dumps(r) + "\n" for r in rows)
    if partial_line:
        # a job still writing its next line
        text += '{"step": 35, "time": 11'
    (path / "metrics.jsonl").write_text(text)
    (path / "run.json").write_text(
        json.dumps(
            {
                "world_size": 4,
                "micro_batch": 8,
                "accumulate": 2,
                "global_batch": 64,
                "backend": "gloo",
                "device": "cpu",
                "started_at": 990.0,
            }
        )
    )
    (path / "config.yaml").write_text("checkpoint:\n  monitor: accuracy\n  mode: max\n")
    return path


def test_panels_and_png_files_for_one_run(tmp_path):
    run = load_run(str(_fake_run(tmp_path / "exp" / "a")))
    titles = [p.title for p in panels_for([run])]
    assert titles == ["loss", "eval/accuracy", "learning rate", "throughput (samples/s)", "train/grad_norm"]
    files = draw([run], str(tmp_path / "out"))
    assert len(files) == len(titles) + 1 and files[-1].endswith("report.png")
    for f in files:
        data = Path(f).read_bytes()
        assert data.startswith(PNG_MAGIC) and len(data) > 5000


def test_summary_and_cli_on_a_run_that_is_still_writing(tmp_path, capsys):
    run_dir = _fake_run(tmp_path / "exp" / "a")
    assert main(["report", str(run_dir)]) == 0
    out = capsys.readouterr().out
    assert "30 steps (3.00 epochs)" in out
    assert "4 ranks x micro-batch 8 x accumulate 2 = effective batch 64" in out
    # started_at 990 to the last line at 1100
    assert "wall time 1m50s" in out
    assert "best eval/accuracy 0.8 at step 30 (max)" in out
    assert "heldout/accuracy 0.8" in out and "no final model yet" in out
    assert (run_dir / "results" / "report" / "report.png").exists()


def test_several_runs_are_overlaid_in_the_same_panels(tmp_path, capsys):
    a = _fake_run(tmp_path / "exp" / "a")
    b = _fake_run(tmp_path / "exp" / "b", steps=50, offset=0.1, partial_line=False)
    out_dir = tmp_path / "compare"
    assert main(["report", str(a), str(b), "--out", str(out_dir)]) == 0
    assert len(list(out_dir.glob("*.png"))) == 6
    printed = capsys.readouterr().out
    assert str(a) in printed and str(b) in printed and "50 steps" in printed


@pytest.mark.parametrize(
    "make,expected",
    [
        (lambda p: p, "does not exist"),
        (lambda p: p.mkdir() or p, "has no metrics.jsonl"),
    ],
)
def test_not_a_run_directory_is_one_line_and_exit_2(tmp_path, capsys, make, expected):
    path = make(tmp_path / "nope")
    assert main(["report", str(path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and expected in err[0]


def test_each_ranks_forward_and_data_wait_are_drawn_beside_the_step_where_the_rank_existed(tmp_path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from ddplab.tools.report import _plot_ranks

    path = _fake_run(tmp_path / "exp" / "r", partial_line=False)
    # two records of two ranks, then one after the job grew to three (seconds per step)
    records = [
        {
            "step": 10,
            "ranks": {"step_s": [0.04, 0.05], "data_s": [0.001, 0.03], "forward_s": [0.01, 0.012], "steps": 10},
        },
        {
            "step": 20,
            "ranks": {"step_s": [0.05, 0.04], "data_s": [0.002, 0.02], "forward_s": [0.011, 0.01], "steps": 10},
        },
        {
            "step": 30,
            "ranks": {"step_s": [0.03] * 3, "data_s": [0.001] * 3, "forward_s": [0.02, 0.02, 0.025], "steps": 10},
        },
    ]
    with open(path / "metrics.jsonl", "a") as f:
        f.writelines(json.dumps({"time": 1200.0, **r}) + "\n" for r in records)
    run = load_run(str(path))
    assert [p.title for p in panels_for([run])][-1] == "time per step by rank"
    fig, ax = plt.subplots()
    _plot_ranks(ax, [run])
    drawn = {line.get_label(): (list(line.get_xdata()), [round(y, 6) for y in line.get_ydata()]) for line in ax.lines}
    plt.close(fig)
    assert drawn == {
        "rank 0 forward": ([10, 20, 30], [10.0, 11.0, 20.0]),
        "rank 0 data wait": ([10, 20, 30], [1.0, 2.0, 1.0]),
        "rank 1 forward": ([10, 20, 30], [12.0, 10.0, 20.0]),
        "rank 1 data wait": ([10, 20, 30], [30.0, 20.0, 1.0]),
        "rank 2 forward": ([30], [25.0]),
        "rank 2 data wait": ([30], [1.0]),
        "step": ([10, 20, 30], [50.0, 50.0, 30.0]),
    }
    assert [line.get_linestyle() for line in ax.lines][:2] == ["-", "--"]
    files = draw([run], str(tmp_path / "out"))
    assert any(f.endswith("time_per_step_by_rank.png") for f in files)


@pytest.mark.parametrize(
    "run_json",
    ['{"backend": "gloo"}', "[1, 2]", '{"world_size": 2, "micro_batch": "x"}', "{not json"],
)
def test_a_report_of_a_damaged_run_folder_shows_what_it_can(tmp_path, capsys, run_json):
    """run.json written in part or overwritten, lines of metrics.jsonl that are not rows: no KeyError."""
    run_dir = tmp_path / "exp" / "r"
    run_dir.mkdir(parents=True)
    rows = ['{"step": 1, "time": 5.0, "train/loss": 1.0}', "garbage", '{"step": "a"}', '{"step": 3, "time": "x"}']
    (run_dir / "metrics.jsonl").write_text("\n".join(rows) + "\n")
    (run_dir / "run.json").write_text(run_json)
    assert main(["report", str(run_dir)]) == 0
    out = capsys.readouterr().out
    assert "3 steps" in out and "effective batch" not in out


def test_a_series_of_one_point_is_drawn_with_a_marker(tmp_path):
    matplotlib.use("Agg")
    # a run that logged once: a line of no length would show nothing
    run = load_run(str(_fake_run(tmp_path / "exp" / "one", steps=5, eval_every=5, partial_line=False)))
    for panel in panels_for([run]):
        fig, ax = plt.subplots()
        _plot_panel(ax, panel, [run])
        single = [line for line in ax.lines if len(line.get_xdata()) == 1]
        assert single and all(line.get_marker() not in (None, "None", "") for line in single), panel.title
        plt.close(fig)
