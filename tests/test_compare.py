"""Run comparison on hand-written workdirs: best validation per metric direction (BLEU up,
perplexity down), the logged training time (after a resume; unknown in older workdirs),
differing config columns, workdir expansion (globs, commas inside sweep point names) and refusal
to mix families or metrics."""

import csv
import io
import json
import warnings
from pathlib import Path

import numpy as np
import pytest

from xformer import compare
from xformer import config as config_lib
from xformer.config import base_config, lm_base_config


def make_run(
    directory: Path, config, rows, test=None, num_params=None, done_step=None, starts=()
) -> str:
    """A workdir; `starts`: (commit, dirty) of each train.py start, recorded in run_info.json."""
    directory.mkdir(parents=True)
    (directory / "config.json").write_text(config.to_json())
    (directory / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    if test is not None:
        (directory / f"eval_{config.data.test_split}.json").write_text(json.dumps(test))
    if num_params is not None:
        starts = [{"commit": commit, "dirty": dirty} for commit, dirty in starts]
        info = {"num_params": num_params, "starts": starts}
        (directory / "run_info.json").write_text(json.dumps(info))
    if done_step is not None:
        done = {"step": done_step, "reason": "num_steps", "metrics": {}}
        (directory / "done.json").write_text(json.dumps(done))
    return str(directory)


def train_row(step, seconds, tokens_per_s=100.0, **more):
    return {
        "step": step,
        "train/steps_per_s": 10.0,
        "train/tokens_per_s": tokens_per_s,
        "train/train_seconds": seconds,
        **{f"train/{name}": value for name, value in more.items()},
    }


def val_row(step, seconds, split="val", **metrics):
    row = {f"{split}/{name}": value for name, value in metrics.items()}
    return {"step": step, "train/train_seconds": seconds, **row}


def translation_config(**train):
    c = base_config()
    c.train.log_every = 50
    c.train.update(train)
    return c


def test_translation_best_bleu_is_the_highest(tmp_path):
    rows_a = [
        train_row(50, 5.0),
        train_row(100, 10.0),
        val_row(100, 10.0, bleu=10.0, lc_tok_bleu=12.0),
    ]
    rows_a += [train_row(150, 15.0), val_row(150, 15.0, bleu=30.0, lc_tok_bleu=29.0)]
    rows_a += [train_row(200, 20.0), val_row(200, 20.0, bleu=20.0, lc_tok_bleu=33.0)]
    a = make_run(
        tmp_path / "a",
        translation_config(),
        rows_a,
        test={"step": 200, "sacrebleu": 25.5, "lc_tok_bleu": 40.25},
        num_params=1234,
        done_step=200,
        starts=[("0123456789abcdef", False), ("fedcba9876543210", True)],
    )
    b = make_run(
        tmp_path / "b",
        translation_config(learning_rate=1e-3),
        [train_row(50, 10.0, 50.0), val_row(50, 10.0, bleu=1.0, lc_tok_bleu=2.0)],
    )
    result = compare.compare([a, b])
    assert result.differing == ["train.learning_rate"]
    table = list(csv.DictReader(io.StringIO(compare.to_csv(result))))
    assert [r["run"] for r in table] == ["a", "b"]
    assert (
        table[0]["train.learning_rate"] == "0.0007" and table[1]["train.learning_rate"] == "0.001"
    )
    assert float(table[0]["best_val_bleu"]) == 30.0
    assert int(table[0]["best_val_bleu_step"]) == 150
    assert float(table[0]["best_val_lc_tok_bleu"]) == 33.0
    assert float(table[0]["test_2016_flickr_bleu"]) == 25.5
    assert float(table[0]["test_2016_flickr_lc_tok_bleu"]) == 40.25
    assert table[0]["params"] == "1234" and table[1]["params"] == ""
    assert table[0]["steps"] == "200" and table[1]["steps"] == "50"  # done.json, else metrics
    assert float(table[0]["train_seconds"]) == pytest.approx(20.0)
    assert float(table[1]["train_seconds"]) == pytest.approx(10.0)
    assert table[1]["test_2016_flickr_bleu"] == ""
    markdown = compare.to_markdown(result)
    assert table[0]["commit"] == "01234567->fedcba98+dirty" and table[1]["commit"] == ""
    row = "| a | 0.0007 | 01234567->fedcba98+dirty | 1,234 | 200 | 20.0s | 100.00 | 30.00 | 150 |"
    assert row in markdown
    assert "more than one commit or with uncommitted changes: a" in markdown
    assert "different commits" not in markdown  # b recorded none

    out = tmp_path / "out"
    paths = compare.write(result, str(out))
    assert Path(paths["png"]).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (out / "compare.md").read_text() == markdown


def test_runs_without_validation_rows_are_plotted_without_a_warning(tmp_path):
    """Runs stopped before their first validation: compare.png says so (matplotlib warned of a
    legend without lines)."""
    runs = [make_run(tmp_path / n, translation_config(), [train_row(50, 5.0)]) for n in "ab"]
    result = compare.compare(runs)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        paths = compare.write(result, str(tmp_path / "out"))
    assert Path(paths["png"]).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_language_model_best_is_the_lowest_and_time_is_the_last_logged(tmp_path):
    c = lm_base_config("ptb")
    c.train.log_every = 50

    def valid(step, seconds, perplexity):
        return val_row(step, seconds, split="valid", perplexity=perplexity)

    rows = [train_row(50, 5.0), train_row(100, 10.0), valid(100, 10.0, 300.0)]
    # killed after logging step 150; resumed from the step-100 checkpoint (10 s), redoing 101..150
    rows += [train_row(150, 15.0)]
    rows += [train_row(150, 17.0), train_row(200, 22.0), valid(200, 22.0, 250.0)]
    rows += [train_row(220, 24.0), valid(220, 24.0, 260.0)]  # stopped at max_train_seconds
    rows += [train_row(250, 27.0)]  # resumed from the step-220 checkpoint
    run = make_run(
        tmp_path / "xl", c, rows, test={"step": 250, "metric": "perplexity", "perplexity": 255.0}
    )
    other = lm_base_config("ptb")
    other.model.mem_len = 10
    other.train.log_every = 50
    old = [{"step": 100, "train/steps_per_s": 10.0}, {"step": 100, "valid/perplexity": 200.0}]
    run2 = make_run(tmp_path / "xl2", other, old)  # written before train_seconds was logged
    result = compare.compare([run, run2])
    assert [m.name for m in result.metrics] == ["perplexity"]
    row = dict(zip(result.columns, result.rows[0], strict=True))
    assert row["best_valid_perplexity"] == 250.0 and row["best_valid_perplexity_step"] == 200
    assert row["test_perplexity"] == 255.0
    assert row["train_seconds"] == 27.0
    curve = compare.Run.load(run).curve(result.metrics[0])
    assert curve == [(100, 10.0, 300.0), (200, 22.0, 250.0), (220, 24.0, 260.0)]
    assert dict(zip(result.columns, result.rows[1], strict=True))["train_seconds"] is None
    assert compare.Run.load(run2).curve(result.metrics[0]) == [(100, None, 200.0)]
    paths = compare.write(result, str(tmp_path / "out"))  # the old run only in the step plot
    assert Path(paths["png"]).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_mixed_families_or_metrics_are_refused(tmp_path):
    translation = make_run(tmp_path / "mt", translation_config(), [])
    word = make_run(tmp_path / "word", lm_base_config("ptb"), [])
    char = make_run(tmp_path / "char", lm_base_config("ptb_char"), [])
    with pytest.raises(ValueError, match=r"different families.*translation.*mt.*LM.*word"):
        compare.compare([translation, word])
    with pytest.raises(ValueError, match=r"LM \(perplexity\): word; LM \(bpc\): char"):
        compare.compare([word, char])


def test_expand_globs_commas_and_point_names_with_commas(tmp_path):
    names = ["d_model=16,seed=0", "d_model=16,seed=1", "plain"]
    for name in names:
        make_run(tmp_path / name, lm_base_config("ptb"), [])
    (tmp_path / "not_a_run").mkdir()
    (tmp_path / "compare.md").write_text("")
    expected = [str(tmp_path / name) for name in names]
    assert compare.expand([f"{tmp_path}/*"]) == sorted(expected)
    assert compare.expand([",".join(expected)]) == expected
    assert compare.expand([expected[1], f"{tmp_path}/d_*"]) == [expected[1], expected[0]]
    assert compare.default_out_dir(expected) == str(tmp_path)
    with pytest.raises(FileNotFoundError, match="no train.py workdir matches"):
        compare.expand([f"{tmp_path}/x*"])
    with pytest.raises(FileNotFoundError, match="is 'nope' a train.py workdir"):
        compare.compare(compare.expand(["nope"]))


def test_runs_of_different_commits_are_flagged(tmp_path):
    runs = [
        make_run(
            tmp_path / name,
            translation_config(),
            [train_row(50, 5.0)],
            num_params=1,
            starts=[(commit, False)],
        )
        for name, commit in (("x", "aaaaaaaaaa"), ("y", "aaaaaaaaaa"), ("z", "bbbbbbbbbb"))
    ]
    same = compare.compare(runs[:2])
    assert same.notes == [] and [r[1] for r in same.rows] == ["aaaaaaaa", "aaaaaaaa"]
    mixed = compare.to_markdown(compare.compare(runs))
    assert "trained by different commits" in mixed


def test_runs_that_differ_only_by_seed_are_grouped(tmp_path):
    """Mean and sample standard deviation over seeds per configuration; "≈" marks a mean
    within the larger standard deviation of the best one's."""
    # 1e-3: 30.81 +- 1.28, the best. 2e-3: 30.0 +- 0.28, 0.81 away: within 1.28. 3e-3: one
    # seed, 0.31 away: not judged. 4e-3: 28.8 +- 3.96, 2.01 away: within its own deviation,
    # the larger one (not within the best's).
    scores = {
        1e-3: [29.5, 31.0, 32.5, 30.25],
        2e-3: [30.2, 29.8],
        3e-3: [30.5],
        4e-3: [26.0, 31.6],
    }
    workdirs = []
    for lr, values in scores.items():
        for seed, value in enumerate(values):
            c = translation_config(learning_rate=lr, seed=seed)
            rows = [train_row(50, 5.0), val_row(50, 5.0, bleu=value - 1, lc_tok_bleu=value)]
            test = {"step": 50, "sacrebleu": value, "lc_tok_bleu": value + 1}
            workdirs.append(make_run(tmp_path / f"lr{lr}_s{seed}", c, rows, test=test))
    result = compare.compare(workdirs)
    assert result.differing == ["train.learning_rate", "train.seed"]
    groups = compare.seed_groups(result)
    assert [g.config for g in groups] == [{"train.learning_rate": lr} for lr in scores]
    column = "test_2016_flickr_bleu"
    for g, values in zip(groups, scores.values(), strict=True):
        mean, std, n = g.stats[column]
        assert mean == pytest.approx(np.mean(values)) and n == len(values)
        if n > 1:
            assert std == pytest.approx(np.std(values, ddof=1))
        else:
            assert std is None
    assert [g.best[column] for g in groups] == [True, False, False, False]
    assert [g.within_noise[column] for g in groups] == [False, True, False, True]
    assert groups[1].within_noise["best_val_bleu"]  # the same values, shifted by 1

    markdown = compare.to_markdown(result)
    assert "### Over seeds" in markdown
    assert "| 0.001 | 4 | " in markdown and "30.81 ± 1.28 (n=4) best" in markdown
    assert "30.00 ± 0.28 (n=2) ≈" in markdown and "30.50 (n=1) |" in markdown
    bpc = compare.SeedGroup(
        {}, ["a", "b", "c"], {"bpc": (1.75123, 0.00314, 3), "one": (1.2, None, 1)}
    )
    assert compare._stat_cell(bpc, "bpc") == "1.7512 ± 0.0031 (n=3)"  # not "1.75 ± 0.00"
    assert compare._stat_cell(bpc, "one") == "1.2000 (n=1)"
    paths = compare.write(result, str(tmp_path / "out"))
    table = list(csv.DictReader(io.StringIO(Path(paths["seeds_csv"]).read_text())))
    assert table[1]["runs"] == "lr0.002_s0;lr0.002_s1"
    assert float(table[1][f"{column}_std"]) == pytest.approx(np.std([30.2, 29.8], ddof=1))
    assert table[1][f"{column}_within_noise_of_best"] == "True"
    assert "seeds_csv" not in compare.write(compare.compare(workdirs[:1]), str(tmp_path / "one"))


def test_mfu_column_where_a_run_logged_it(tmp_path):
    """train/mfu (logged where the devices' peak is known): its median per run, a column only
    when some run has it."""
    mfus = [0.31, 0.12, 0.29]
    a = make_run(
        tmp_path / "a",
        translation_config(),
        [train_row(50 * (i + 1), 5.0 * (i + 1), mfu=m) for i, m in enumerate(mfus)],
    )
    b = make_run(tmp_path / "b", translation_config(learning_rate=1e-3), [train_row(50, 5.0)])
    result = compare.compare([a, b])
    table = list(csv.DictReader(io.StringIO(compare.to_csv(result))))
    assert float(table[0]["median_mfu"]) == 0.29 and table[1]["median_mfu"] == ""
    assert "| 29.0% |" in compare.to_markdown(result)
    assert "median_mfu" not in compare.compare([b]).columns


def test_an_eval_of_an_earlier_step_is_not_the_runs_result(tmp_path):
    """An eval_<test split>.json of a step before the run's last (the run trained on after
    eval.py ran) leaves the test cells empty, with a note; one of the final step is shown."""
    stale_bleu, final_bleu = np.random.default_rng().uniform(10, 40, 2)
    rows = [train_row(100, 10.0), val_row(100, 10.0, bleu=5.0, lc_tok_bleu=5.0)]
    rows += [train_row(200, 20.0), val_row(200, 20.0, bleu=6.0, lc_tok_bleu=6.0)]
    workdirs = [
        make_run(
            tmp_path / name,
            translation_config(),
            rows,
            test={"step": step, "sacrebleu": bleu, "lc_tok_bleu": bleu + 1},
            done_step=done_step,
        )
        for name, step, bleu, done_step in (
            ("stale", 100, stale_bleu, 200),
            ("final", 200, final_bleu, None),  # its last step from metrics.jsonl
        )
    ]
    result = compare.compare(workdirs)
    table = list(csv.DictReader(io.StringIO(compare.to_csv(result))))
    assert table[0]["test_2016_flickr_bleu"] == table[0]["test_2016_flickr_lc_tok_bleu"] == ""
    assert float(table[1]["test_2016_flickr_bleu"]) == final_bleu
    assert float(table[1]["test_2016_flickr_lc_tok_bleu"]) == final_bleu + 1
    note = (
        "stale: eval_test_2016_flickr.json is of step 100, the run reached step 200: rerun "
        "eval.py (its test cells are left empty)"
    )
    assert result.notes == [note]
    assert f"**Note.** {note}" in compare.to_markdown(result)


def test_a_nan_validation_value_is_never_the_best(tmp_path):
    """max and min keep a NaN that comes first (every comparison with it is False): the best
    validation BLEU is the best number."""
    bleu = np.random.default_rng().uniform(10, 40)
    rows = [train_row(100, 10.0), val_row(100, 10.0, bleu=float("nan"), lc_tok_bleu=1.0)]
    rows += [val_row(200, 20.0, bleu=bleu, lc_tok_bleu=2.0), val_row(300, 30.0, bleu=bleu / 2)]
    result = compare.compare([make_run(tmp_path / "a", translation_config(), rows)])
    table = list(csv.DictReader(io.StringIO(compare.to_csv(result))))
    assert float(table[0]["best_val_bleu"]) == bleu and table[0]["best_val_bleu_step"] == "200"


def test_test_results_of_different_evaluation_settings_are_flagged(tmp_path):
    """Runs whose eval_test.json used other evaluation lengths (their configs' eval.mem_len, or
    an eval.py of before 2026-11-29 given --mem_len) get a note naming the keys that differ; the
    same settings get none."""
    rng = np.random.default_rng()

    def run(name, mem_len):
        test = {"step": 10, "metric": "perplexity", "perplexity": rng.uniform(80, 200)}
        test.update(eval_batch_size=10, eval_mem_len=mem_len, eval_decoder_mask="causal")
        rows = [train_row(10, 1.0), val_row(10, 1.0, split="valid", perplexity=150.0)]
        return make_run(tmp_path / name, lm_base_config("ptb"), rows, test=test)

    same = compare.compare([run("a", 64), run("b", 64)])
    assert same.notes == []
    mixed = compare.compare([run("c", 64), run("d", 640)])
    assert mixed.notes == [
        "The test results were evaluated with different settings (c: eval_mem_len=64; d: "
        "eval_mem_len=640): set them in the runs' configs (eval.*), or compare the results of "
        "eval.py given the same flags."
    ]
    # Translation: the same settings, inputs cut at another length (learned positions' table)
    tests = [{"beam_size": 4, "max_input_tokens": 512, "input_token_limit": n} for n in (512, 256)]
    assert compare.settings_notes(dict(zip("ef", tests, strict=True))) == []
    tests[1]["max_input_tokens"] = 256
    assert (
        "e: max_input_tokens=512; f: max_input_tokens=256"
        in compare.settings_notes(dict(zip("ef", tests, strict=True)))[0]
    )


def test_a_shell_expanded_glob_skips_what_is_not_a_workdir(tmp_path):
    """`eval.py --compare dir/*` again, after compare wrote compare.md, .csv and .png into dir:
    among several arguments, existing paths that are not workdirs are skipped. A path named
    alone or in a comma list, or one that does not exist, must be a workdir."""
    runs = [
        make_run(
            tmp_path / f"lr{i}",
            translation_config(learning_rate=lr),
            [train_row(50, 5.0), val_row(50, 5.0, bleu=lr, lc_tok_bleu=lr)],
        )
        for i, lr in enumerate(np.random.default_rng().uniform(1e-4, 1e-3, 2))
    ]
    compare.write(compare.compare(runs), str(tmp_path))
    (tmp_path / "logs").mkdir()
    argv = sorted(str(p) for p in tmp_path.iterdir())  # as the shell expands dir/*
    assert argv[0] == str(tmp_path / "compare.csv")
    assert compare.expand(argv) == runs
    assert compare.compare(compare.expand(argv)).names == ["lr0", "lr1"]
    named = str(tmp_path / "compare.md")
    for args in ([named], [f"{runs[0]},{named}"], [*runs, str(tmp_path / "nope")]):
        with pytest.raises(FileNotFoundError, match="a train.py workdir"):
            compare.compare(compare.expand(args))
    with pytest.raises(FileNotFoundError, match="no train.py workdir among"):
        compare.expand([named, str(tmp_path / "logs")])


def test_an_older_config_gets_todays_defaults(tmp_path):
    """A config.json written before some keys existed compares as if it held their defaults:
    no differing column for them, one seed group, and its test split known."""
    values = np.random.default_rng().uniform(10, 40, 2)
    workdirs = []
    for seed, value in enumerate(values):
        rows = [train_row(50, 5.0), val_row(50, 5.0, bleu=value, lc_tok_bleu=value)]
        test = {"step": 50, "sacrebleu": value, "lc_tok_bleu": value}
        c = translation_config(seed=seed)
        workdirs.append(make_run(tmp_path / f"s{seed}", c, rows, test=test))
    path = Path(workdirs[0]) / "config.json"
    stored = json.loads(path.read_text())
    del stored["data"]["test_split"], stored["train"]["peak_tflops"]
    path.write_text(json.dumps(stored))
    result = compare.compare(workdirs)
    assert result.differing == ["train.seed"]
    [group] = compare.seed_groups(result)
    mean, std, n = group.stats["test_2016_flickr_bleu"]
    assert n == 2 and mean == pytest.approx(np.mean(values))
    assert std == pytest.approx(np.std(values, ddof=1))


def test_an_older_language_model_config_gets_the_language_model_defaults():
    stored = json.loads(lm_base_config("ptb").to_json())
    del stored["data"]["test_split"], stored["data"]["eval_split"]
    config, added = config_lib.with_defaults(stored)
    assert sorted(added) == ["data.eval_split", "data.test_split"]
    assert (config.data.eval_split, config.data.test_split) == ("valid", "test")


def test_rows_a_resumed_run_logged_again_are_the_resumed_runs(tmp_path):
    """A run that crashed at step 130 after its step-100 checkpoint and was resumed logs steps
    110 and 120 again: the last row written of each step and kind counts, in step order."""
    rng = np.random.default_rng()
    first, lost, resumed = rng.uniform(10, 20), rng.uniform(30, 40, 2), rng.uniform(10, 20, 3)
    speeds, lost_speeds = rng.uniform(100, 200, 4), rng.uniform(1e4, 2e4, 2)
    rows = [train_row(100, 10.0, speeds[0]), val_row(100, 10.0, bleu=first, lc_tok_bleu=first)]
    for step, bleu, speed in zip((110, 120), lost, lost_speeds, strict=True):  # lost in the crash
        rows += [train_row(step, step / 10, speed), val_row(step, step / 10, bleu=bleu)]
    for step, bleu, speed in zip((110, 120, 130), resumed, speeds[1:], strict=True):
        seconds = step / 10 + 0.5
        rows += [train_row(step, seconds, speed), val_row(step, seconds, bleu=bleu)]
    workdir = make_run(tmp_path / "resumed", translation_config(), rows)
    run = compare.Run.load(workdir)
    expected = [(100, 10.0, first)] + [
        (step, step / 10 + 0.5, bleu) for step, bleu in zip((110, 120, 130), resumed, strict=True)
    ]
    assert run.curve(compare.BLEU[0]) == expected
    assert [r["step"] for r in run.rows] == [100, 100, 110, 110, 120, 120, 130, 130]
    result = compare.compare([workdir])
    row = dict(zip(result.columns, result.rows[0], strict=True))
    assert row["best_val_bleu"] == max(first, *resumed)
    assert row["median_tokens_per_s"] == pytest.approx(np.median(speeds))
    assert row["steps"] == 130 and row["train_seconds"] == 13.5


def test_an_averaged_workdir_is_named_for_what_it_averaged(tmp_path):
    """average.py's output has no metrics of its own: its row holds the last step averaged and
    the test result eval.py wrote there, and a note says what it averages."""
    bleu = float(np.random.default_rng().uniform(10, 40))
    rows = [train_row(100, 10.0), val_row(100, 10.0, bleu=5.0, lc_tok_bleu=5.0)]
    source = make_run(tmp_path / "run", translation_config(), rows, done_step=100)
    averaged = make_run(
        tmp_path / "run_avg2", translation_config(), [], test={"step": 100, "sacrebleu": bleu}
    )
    info = {"source": source, "averaged_steps": [50, 100]}
    (tmp_path / "run_avg2" / "averaged.json").write_text(json.dumps(info))
    result = compare.compare([source, averaged])
    table = list(csv.DictReader(io.StringIO(compare.to_csv(result))))
    assert table[1]["steps"] == "100" and float(table[1]["test_2016_flickr_bleu"]) == bleu
    assert result.notes == [
        f"run_avg2: the average of checkpoints [50, 100] of {source} (average.py): no training "
        "or validation rows of its own"
    ]


def test_seed_groups_keep_averaged_runs_apart_and_count_what_is_not_finite(tmp_path):
    """An average.py workdir is not one more seed of the runs it averaged; a diverged seed's inf
    perplexity makes its group's mean inf (no deviation; before, the table crashed on it and
    left compare.md empty), a nan mean is never the best; notes name a group whose runs stopped
    at different steps."""
    rng = np.random.default_rng()
    tests = {  # positional scheme -> (steps, test perplexity) per seed
        "relative": [(750, 140.0 + rng.uniform()), (750, 142.0 + rng.uniform())],
        "rope": [(750, 130.0), (750, float("inf"))],
        "alibi": [(750, float("nan")), (300, 90.0)],
    }
    workdirs = []
    for scheme, runs in tests.items():
        for seed, (steps, perplexity) in enumerate(runs):
            c = lm_base_config("ptb")
            c.model.positional, c.train.seed = scheme, seed
            rows = [train_row(steps, 10.0)]
            test = {"step": steps, "metric": "perplexity", "perplexity": perplexity}
            workdirs.append(make_run(tmp_path / f"{scheme}_s{seed}", c, rows, test=test))
    averaged_perplexity = 120.0 + rng.uniform()
    config = lm_base_config("ptb")  # relative_s0's
    config.model.positional, config.train.seed = "relative", 0
    averaged = tmp_path / "relative_s0.avg2"
    make_run(
        averaged,
        config,
        [],
        test={"step": 750, "metric": "perplexity", "perplexity": averaged_perplexity},
    )
    (averaged / "averaged.json").write_text(
        json.dumps({"source": workdirs[0], "averaged_steps": [700, 750]})
    )
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "compare.md").write_text("an earlier report\n")
    result = compare.compare([*workdirs, str(averaged)])
    groups = compare.seed_groups(result)
    column = "test_perplexity"
    assert [(g.config["model.positional"], g.config["averaged"]) for g in groups] == [
        ("relative", "no"),
        ("rope", "no"),
        ("alibi", "no"),
        ("relative", "2 checkpoints"),
    ]
    relative, rope, alibi, average = groups
    values = [p for _, p in tests["relative"]]
    assert relative.stats[column] == pytest.approx((np.mean(values), np.std(values, ddof=1), 2))
    assert average.stats[column] == (averaged_perplexity, None, 1)
    assert rope.stats[column] == (float("inf"), None, 2)
    assert np.isnan(alibi.stats[column][0]) and column not in alibi.best
    assert [g.best.get(column) for g in (relative, rope, average)] == [False, False, True]
    assert alibi.notes == [
        "the runs alibi_s0, alibi_s1 stopped at different steps (alibi_s0 750, alibi_s1 300): "
        "their mean mixes them"
    ]
    assert relative.notes == rope.notes == average.notes == []
    paths = compare.write(result, str(tmp_path / "out"))
    markdown = Path(paths["md"]).read_text()
    assert "| rope | no | 2 | " in markdown and "inf (n=2)" in markdown
    assert "nan (n=2)" in markdown and "stopped at different steps" in markdown
