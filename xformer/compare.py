"""Compare finished runs: one table row per workdir, and the validation curves in one plot.

A row holds the run's name (its workdir's base name), the config values that differ across the
runs (config.json flattened to dotted keys), the commit(s) that trained each run and the
parameter count (run_info.json; a note under the table when the commits differ), the final step,
the training wall time, the median training tokens/s, the best validation value of the family's
metric and its step, and the test value from eval.py's eval_<config.data.test_split>.json when
it is of the final step (else a note under the table says to rerun eval.py). An average.py
workdir's row has the last step it averaged, and a note naming the checkpoints and their run.

An older config.json gets today's defaults for the keys it lacks (config.with_defaults). Of the
rows that a resumed run logged again (for steps after its checkpoint that a crash lost), the
last written count.

Metrics: BLEU for translation (sacreBLEU, and the lowercased tokenized BLEU of Multi30k papers;
higher is better), perplexity for word-level and bits per character for character-level
language models (`DatasetEntry.metric`; lower is better). Runs of different families or metrics
cannot be compared.

Training wall time is the train/train_seconds that train.py logs (compilation, start-up,
evaluation and checkpoints excluded; continued across resumes); unknown for older workdirs.
"""

import csv
import dataclasses
import glob
import io
import json
import math
import os
import statistics
from collections.abc import Sequence
from typing import Any

from xformer.config import flatten
from xformer.experiment import AVERAGED_FILE, CONFIG_FILE, load_config
from xformer.files import read_json_if_present, read_jsonl
from xformer.timing import format_duration
from xformer.train_lib import DONE_FILE, RUN_INFO_FILE


@dataclasses.dataclass(frozen=True)
class Metric:
    name: str  # e.g. "perplexity"; the validation rows log "<eval_split>/<name>"
    eval_key: str  # its key in eval.py's eval_<split>.json
    higher_is_better: bool


TRAIN_SECONDS = "train/train_seconds"  # in train and validation rows of metrics.jsonl

BLEU = (Metric("bleu", "sacrebleu", True), Metric("lc_tok_bleu", "lc_tok_bleu", True))
LM_METRICS = {
    "perplexity": Metric("perplexity", "perplexity", False),
    "bpc": Metric("bpc", "bpc", False),
}


@dataclasses.dataclass
class Run:
    """What a train.py / eval.py workdir recorded."""

    workdir: str
    config: dict[str, Any]  # config.json as {dotted key: value}
    rows: list[dict]  # metrics.jsonl
    run_info: dict | None
    done: dict | None
    test: dict | None  # eval_<test split>.json
    averaged: dict | None = None  # average.py's output: {"source", "averaged_steps"}

    @classmethod
    def load(cls, workdir: str) -> "Run":
        config = flatten(load_config(workdir))
        rows = last_written(read_jsonl(os.path.join(workdir, "metrics.jsonl")))

        def optional(name):
            return read_json_if_present(os.path.join(workdir, name))

        test = optional(f"eval_{config['data.test_split']}.json")
        return cls(
            workdir,
            config,
            rows,
            optional(RUN_INFO_FILE),
            optional(DONE_FILE),
            test,
            optional(AVERAGED_FILE),
        )

    @property
    def family(self) -> str:
        return "translation" if self.config["model.family"] == "encoder_decoder" else "LM"

    def metrics(self) -> tuple[Metric, ...]:
        if self.family == "translation":
            return BLEU
        if self.test is not None and "metric" in self.test:
            return (LM_METRICS[self.test["metric"]],)
        from xformer.data.registry import corpus_info

        return (LM_METRICS[corpus_info(self.config["data.dataset"]).metric],)

    @property
    def train_rows(self) -> list[dict]:
        return [r for r in self.rows if "train/steps_per_s" in r]

    def steps(self) -> int | None:
        if self.done is not None:
            return int(self.done["step"])
        if self.averaged is not None:  # (no training rows: the last step averaged)
            return int(self.averaged["averaged_steps"][-1])
        return max((int(r["step"]) for r in self.rows), default=None)

    def averaged_note(self) -> str | None:
        """What an average.py workdir averaged (it has no training rows of its own)."""
        if self.averaged is None:
            return None
        return (
            f"the average of checkpoints {self.averaged['averaged_steps']} of "
            f"{self.averaged['source']} (average.py): no training or validation rows of its own"
        )

    def stale_test(self) -> str | None:
        """Why eval_<test split>.json is not the run's result: it is of an earlier step than the
        run's last (the run trained on after eval.py ran); None when it is, or is absent."""
        final = self.steps()
        if self.test is None or final is None or self.test.get("step", final) >= final:
            return None
        return (
            f"eval_{self.config['data.test_split']}.json is of step {self.test['step']}, the run "
            f"reached step {final}: rerun eval.py (its test cells are left empty)"
        )

    def train_median(self, name: str) -> float | None:
        """The median of train/<name> over the train rows (None: never logged)."""
        values = [r[f"train/{name}"] for r in self.train_rows if f"train/{name}" in r]
        return statistics.median(values) if values else None

    def curve(self, metric: Metric) -> list[tuple[int, float | None, float]]:
        """(step, training seconds so far or None if not logged, value) per validation row."""
        key = f"{self.config['data.eval_split']}/{metric.name}"
        return [
            (int(r["step"]), r.get(TRAIN_SECONDS), float(r[key])) for r in self.rows if key in r
        ]

    def commit(self) -> str | None:
        """The short commit(s) that trained the run, oldest first, "+dirty" when a start had
        uncommitted changes; None for runs recorded before commits were."""
        starts = (self.run_info or {}).get("starts", [])
        commits = list(dict.fromkeys(s.get("commit") for s in starts if "commit" in s))
        if not commits:
            return None
        dirty = "+dirty" if any(s.get("dirty") for s in starts) else ""
        return "->".join((c or "unknown")[:8] for c in commits) + dirty

    def train_seconds(self) -> float | None:
        """The last logged training seconds (None: not logged, e.g. an older workdir)."""
        times = [r[TRAIN_SECONDS] for r in self.rows if TRAIN_SECONDS in r]
        return times[-1] if times else None


def last_written(rows: Sequence[dict]) -> list[dict]:
    """metrics.jsonl's rows, of each step and kind (the metric names' prefixes: "train", the
    eval split) the last written, in step order. A run resumed from a checkpoint logs the steps
    after it again, and metric_writer.py appends."""
    last = {}
    for row in rows:
        kind = sorted({k.split("/")[0] for k in row if "/" in k and k != TRAIN_SECONDS})
        last[(row["step"], *kind)] = row
    return sorted(last.values(), key=lambda r: r["step"])


def _is_workdir(path: str) -> bool:
    return os.path.isfile(os.path.join(path, CONFIG_FILE))


def _split(item: str) -> list[str]:
    """Split at commas, except inside an existing path (sweep point names hold commas)."""
    pieces, out, i = item.split(","), [], 0
    while i < len(pieces):
        for j in range(len(pieces), i, -1):  # the longest join that names something
            joined = ",".join(pieces[i:j])
            if j == i + 1 or os.path.exists(joined) or glob.glob(joined):
                break
        out.append(joined)
        i = j
    return [p for p in out if p]


def expand(patterns: Sequence[str]) -> list[str]:
    """Workdirs from paths, comma-separated lists and glob patterns. A pattern keeps only the
    directories with a config.json; a plain path must be a workdir, except among several
    arguments (a glob the shell expanded, `--compare dir/*`), which skip existing paths that are
    not workdirs (e.g. the compare.md written there before). Order kept, no repeats."""
    workdirs: list[str] = []
    for item in patterns:
        for pattern in _split(item):
            if glob.has_magic(pattern):
                found = [p for p in sorted(glob.glob(pattern)) if _is_workdir(p)]
                if not found:
                    raise FileNotFoundError(f"no train.py workdir matches {pattern!r}")
            elif len(patterns) > 1 and os.path.exists(pattern) and not _is_workdir(pattern):
                found = []
            else:
                found = [pattern]
            workdirs += [os.path.normpath(p) for p in found if os.path.normpath(p) not in workdirs]
    if patterns and not workdirs:
        raise FileNotFoundError(f"no train.py workdir among {', '.join(patterns)}")
    return workdirs


def _names(workdirs: Sequence[str]) -> list[str]:
    names = [os.path.basename(os.path.abspath(w)) for w in workdirs]
    if len(set(names)) < len(names):  # e.g. a/run and b/run: paths below the common parent
        common = os.path.commonpath([os.path.abspath(w) for w in workdirs])
        names = [os.path.relpath(os.path.abspath(w), common) for w in workdirs]
    return names


@dataclasses.dataclass
class Comparison:
    runs: list[Run]
    names: list[str]
    differing: list[str]  # config keys whose values differ across the runs
    metrics: tuple[Metric, ...]
    columns: list[str]
    rows: list[list[Any]]  # raw values, one list per run, in column order (None: unknown)
    notes: list[str] = dataclasses.field(default_factory=list)  # printed under the table
    metric_columns: dict[str, Metric] = dataclasses.field(default_factory=dict)  # value columns


@dataclasses.dataclass
class SeedGroup:
    """Runs whose configs differ only in train.seed: each metric column's mean, sample
    standard deviation (None for one seed) and seed count, and whether the mean is within seed
    noise of the best group's (|difference| < the larger of the two standard deviations)."""

    config: dict[str, Any]  # the group's values of the differing keys other than train.seed
    names: list[str]
    stats: dict[str, tuple[float, float | None, int]]  # column -> (mean, std, n)
    best: dict[str, bool] = dataclasses.field(default_factory=dict)
    within_noise: dict[str, bool] = dataclasses.field(default_factory=dict)
    notes: list[str] = dataclasses.field(default_factory=list)  # printed under the table


def compare(workdirs: Sequence[str]) -> Comparison:
    """The comparison table of `workdirs`; ValueError if they are of different families."""
    if not workdirs:
        raise ValueError("nothing to compare: no workdirs given")
    runs = [Run.load(w) for w in workdirs]
    names = _names(workdirs)
    families = {}
    for name, run in zip(names, runs, strict=True):
        families.setdefault((run.family, run.metrics()[0].name), []).append(name)
    if len(families) > 1:
        kinds = "; ".join(
            f"{fam} ({metric}): {', '.join(n)}" for (fam, metric), n in families.items()
        )
        raise ValueError(f"cannot compare runs of different families or metrics: {kinds}")
    metrics = runs[0].metrics()
    keys = sorted(set().union(*(run.config for run in runs)))
    missing = object()
    differing = [
        k
        for k in keys
        if len({json.dumps(r.config.get(k, missing), default=str) for r in runs}) > 1
    ]
    val_split = {r.config["data.eval_split"] for r in runs}
    test_split = {r.config["data.test_split"] for r in runs}
    val = val_split.pop() if len(val_split) == 1 else "val"
    test = test_split.pop() if len(test_split) == 1 else "test"
    columns = [
        "run",
        *differing,
        "commit",
        "params",
        "steps",
        "train_seconds",
        "median_tokens_per_s",
    ]
    mfu = [run.train_median("mfu") for run in runs]  # logged where the devices' peak is known
    has_mfu = any(m is not None for m in mfu)
    if has_mfu:
        columns.append("median_mfu")
    for m in metrics:
        columns += [f"best_{val}_{m.name}", f"best_{val}_{m.name}_step", f"{test}_{m.name}"]
    metric_columns = {}
    for m in metrics:
        metric_columns[f"best_{val}_{m.name}"] = metric_columns[f"{test}_{m.name}"] = m
    rows, notes, shown = [], commit_notes(runs, names), {}
    for name, run, run_mfu in zip(names, runs, mfu, strict=True):
        stale = run.stale_test()
        for note in (run.averaged_note(), stale):
            if note:
                notes.append(f"{name}: {note}")
        test_result = None if stale else run.test
        if test_result is not None:
            shown[name] = test_result
        row = [
            name,
            *(run.config.get(k) for k in differing),
            run.commit(),
            run.run_info["num_params"] if run.run_info else None,
            run.steps(),
            run.train_seconds(),
            run.train_median("tokens_per_s"),
            *([run_mfu] if has_mfu else []),
        ]
        for m in metrics:
            curve = [p for p in run.curve(m) if not math.isnan(p[2])]  # (a diverged pass)
            pick = max if m.higher_is_better else min
            best = pick(curve, key=lambda p: p[2]) if curve else None
            row += [
                best[2] if best else None,
                best[0] if best else None,
                test_result.get(m.eval_key) if test_result else None,
            ]
        rows.append(row)
    notes += settings_notes(shown)
    return Comparison(runs, names, differing, metrics, columns, rows, notes, metric_columns)


SEED_KEY = "train.seed"


def seed_groups(comparison: Comparison) -> list[SeedGroup]:
    """The runs grouped by their config apart from train.seed ([] when no seeds differ), in
    order of first appearance, with the statistics of SeedGroup. average.py workdirs form
    groups of their own ("averaged": how many checkpoints each averaged), apart from the runs
    they average. A non-finite value (a diverged run's perplexity) makes its group's mean inf
    or nan, without a deviation; a nan mean is never the best. Notes name a group's runs that
    stopped at different steps, and seeds that appear twice in a group."""
    if SEED_KEY not in comparison.differing:
        return []
    keys = [k for k in comparison.differing if k != SEED_KEY]
    index = {c: i for i, c in enumerate(comparison.columns)}
    averaged = [
        f"{len(run.averaged['averaged_steps'])} checkpoints" if run.averaged else "no"
        for run in comparison.runs
    ]
    grouped: dict[str, list[int]] = {}
    for i, row in enumerate(comparison.rows):
        key = json.dumps([*(row[index[k]] for k in keys), averaged[i]], default=str)
        grouped.setdefault(key, []).append(i)
    groups = []
    for members in grouped.values():
        stats = {}
        for column in comparison.metric_columns:
            values = [comparison.rows[i][index[column]] for i in members]
            values = [float(v) for v in values if v is not None]
            if values:
                finite = all(math.isfinite(v) for v in values)  # (stdev fails on inf)
                std = statistics.stdev(values) if finite and len(values) > 1 else None
                stats[column] = (statistics.fmean(values), std, len(values))
        first = comparison.rows[members[0]]
        config = {k: first[index[k]] for k in keys}
        if any(a != "no" for a in averaged):
            config["averaged"] = averaged[members[0]]
        names = [comparison.names[i] for i in members]
        notes = _group_notes(comparison, members, names)
        groups.append(SeedGroup(config, names, stats, notes=notes))
    for column, metric in comparison.metric_columns.items():
        scored = [g for g in groups if column in g.stats and not math.isnan(g.stats[column][0])]
        if not scored:
            continue
        pick = max if metric.higher_is_better else min
        top = pick(scored, key=lambda g: g.stats[column][0])
        for g in scored:
            g.best[column] = g is top
            (mean, std, _), (top_mean, top_std, _) = g.stats[column], top.stats[column]
            noise = [x for x in (std, top_std) if x is not None]
            g.within_noise[column] = (
                g is not top and len(noise) == 2 and abs(mean - top_mean) < max(noise)
            )
    return groups


def _group_notes(comparison: Comparison, members: list[int], names: list[str]) -> list[str]:
    """What makes a seed group's statistics (its runs `members`, named `names`) less than they
    seem: runs at different steps (one stopped by a time limit, or still training) and a seed
    counted twice."""
    label = ", ".join(names)
    steps = [comparison.rows[i][comparison.columns.index("steps")] for i in members]
    notes = []
    if len(set(steps)) > 1:
        at = ", ".join(f"{n} {s}" for n, s in zip(names, steps, strict=True))
        notes.append(f"the runs {label} stopped at different steps ({at}): their mean mixes them")
    seeds = [comparison.runs[i].config.get(SEED_KEY) for i in members]
    repeated = sorted({s for s in seeds if seeds.count(s) > 1}, key=str)
    if repeated:
        notes.append(f"the runs {label} repeat seed(s) {repeated}: n counts runs, not seeds")
    return notes


def _stat_cell(group: SeedGroup, column: str) -> str:
    if column not in group.stats:
        return ""
    mean, std, n = group.stats[column]
    if std is None:
        cell = f"{mean:.2f}" if abs(mean) >= 10 else f"{mean:.4f}"
    else:  # two significant digits of the spread, at least two decimals (bpc: 1.7512 ± 0.0031)
        places = 2 if not std > 0 else max(2, 1 - math.floor(math.log10(std)))
        cell = f"{mean:.{places}f} ± {std:.{places}f}"
    cell += f" (n={n})"
    if group.best.get(column):
        cell += " best"
    elif group.within_noise.get(column):
        cell += " ≈"
    return cell


def seeds_to_markdown(groups: list[SeedGroup], columns: Sequence[str]) -> str:
    keys = list(groups[0].config)
    header = [*keys, "runs", *(c.replace("_", " ") for c in columns)]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for g in groups:
        cells = [*(str(g.config[k]) for k in keys), str(len(g.names))]
        cells += [_stat_cell(g, c) for c in columns]
        lines.append("| " + " | ".join(cells) + " |")
    lines.append(
        "\nMean ± sample standard deviation over seeds (n = the seeds with a value). best: the "
        "best mean of the column; ≈: within seed noise of it, i.e. the two means differ by "
        "less than the larger of their two standard deviations (needs n ≥ 2 in both)."
    )
    lines += [f"\n**Note.** {note}" for g in groups for note in g.notes]
    return "\n".join(lines) + "\n"


def seeds_to_csv(groups: list[SeedGroup], columns: Sequence[str]) -> str:
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    keys = list(groups[0].config)
    stat_names = ("mean", "std", "n", "best", "within_noise_of_best")
    writer.writerow([*keys, "runs", *(f"{c}_{s}" for c in columns for s in stat_names)])
    for g in groups:
        row = [*(g.config[k] for k in keys), ";".join(g.names)]
        for c in columns:
            mean, std, n = g.stats.get(c, (None, None, None))
            row += [mean, std, n, g.best.get(c), g.within_noise.get(c)]
        writer.writerow(["" if v is None else v for v in row])
    return out.getvalue()


# The keys of eval.py's results that say how it evaluated (other settings, another measure):
# translation's search, and a language model's eval_* lengths, memory and mask.
TRANSLATION_EVAL_SETTINGS = ("beam_size", "length_penalty", "max_decode_extra", "max_input_tokens")


def settings_notes(tests: dict[str, dict]) -> list[str]:
    """A warning when the test results shown ({run name: eval json}) were evaluated with
    different settings, naming the keys that differ and each run's values."""
    settings = {
        name: {k: v for k, v in t.items() if k in TRANSLATION_EVAL_SETTINGS or k[:5] == "eval_"}
        for name, t in tests.items()
    }
    keys = sorted(
        key
        for key in {k for s in settings.values() for k in s}
        if len({json.dumps(s.get(key)) for s in settings.values()}) > 1
    )
    if not keys:
        return []
    values = "; ".join(
        f"{name}: " + ", ".join(f"{k}={s.get(k)}" for k in keys) for name, s in settings.items()
    )
    return [
        f"The test results were evaluated with different settings ({values}): set them in "
        "the runs' configs (eval.*), or compare the results of eval.py given the same flags."
    ]


def commit_notes(runs: Sequence[Run], names: Sequence[str]) -> list[str]:
    """Warnings when the runs' code differs: several commits, or uncommitted changes."""
    commits = {n: r.commit() for n, r in zip(names, runs, strict=True)}
    notes = []
    if len({c.removesuffix("+dirty") for c in commits.values() if c}) > 1:
        notes.append(
            "These runs were trained by different commits (column commit): a difference may "
            "come from the code, not from the config."
        )
    if any(c and ("->" in c or c.endswith("+dirty")) for c in commits.values()):
        changed = [n for n, c in commits.items() if c and ("->" in c or c.endswith("+dirty"))]
        notes.append(
            "Trained by more than one commit or with uncommitted changes: " + ", ".join(changed)
        )
    return notes


def _cell(value: Any, column: str, config_column: bool) -> str:
    if value is None:
        return ""
    if config_column:
        return json.dumps(value) if isinstance(value, list) else str(value)
    if column == "train_seconds":
        return format_duration(value)
    if column == "median_mfu":
        return f"{value:.1%}"
    if isinstance(value, bool) or column in ("run", "steps") or column.endswith("_step"):
        return str(value)
    if isinstance(value, int):
        return f"{value:,}"
    if isinstance(value, float):
        if not math.isfinite(value) or value == 0 or 1e-3 <= abs(value) < 1e6:
            return f"{value:.4f}" if abs(value) < 10 else f"{value:.2f}"
        return f"{value:.3e}"
    if isinstance(value, list):
        return json.dumps(value)
    return str(value)


def to_markdown(comparison: Comparison) -> str:
    header = [
        c.replace("_", " ") if c not in comparison.differing else c for c in comparison.columns
    ]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for row in comparison.rows:
        cells = [
            _cell(v, c, c in comparison.differing).replace("|", "\\|")
            for v, c in zip(row, comparison.columns, strict=True)
        ]
        lines.append("| " + " | ".join(cells) + " |")
    lines += [f"\n**Note.** {note}" for note in comparison.notes]
    groups = seed_groups(comparison)
    if groups:
        lines += [
            "",
            "### Over seeds",
            "",
            seeds_to_markdown(groups, list(comparison.metric_columns)),
        ]
    return "\n".join(lines) + "\n"


def to_csv(comparison: Comparison) -> str:
    """Raw values (floats at full precision, lists as JSON, unknown as empty)."""
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow(comparison.columns)
    for row in comparison.rows:
        writer.writerow(
            ["" if v is None else json.dumps(v) if isinstance(v, list) else v for v in row]
        )
    return out.getvalue()


def plot(comparison: Comparison, path: str) -> None:
    """The validation metric against steps and against training wall time, one line per run."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    metric = comparison.metrics[0]
    curves = [run.curve(metric) for run in comparison.runs]
    longest = max((t for c in curves for _, t, _ in c if t is not None), default=0.0)
    scale, unit = (60.0, "min") if longest > 120 else (1.0, "s")
    fig, (by_step, by_time) = plt.subplots(1, 2, figsize=(12, 4.5))
    for name, curve in zip(comparison.names, curves, strict=True):
        timed = [(t / scale, value) for _, t, value in curve if t is not None]
        for ax, points in ((by_step, [(s, value) for s, _, value in curve]), (by_time, timed)):
            if points:
                ax.plot(*zip(*points, strict=True), marker="o", markersize=3, label=name)
    split = comparison.runs[0].config["data.eval_split"]
    for ax, xlabel in ((by_step, "step"), (by_time, f"training wall time ({unit})")):
        ax.set_xlabel(xlabel)
        ax.set_ylabel(f"{split} {metric.name}")
        ax.grid(alpha=0.3)
    if any(curves):
        by_step.legend(fontsize="small")  # every run has steps; older runs lack times
    else:  # runs stopped before their first validation
        for ax in (by_step, by_time):
            ax.text(0.5, 0.5, f"no {split} rows yet", ha="center", transform=ax.transAxes)
    fig.suptitle(
        f"{split} {metric.name} ({'higher' if metric.higher_is_better else 'lower'} is better)"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def write(comparison: Comparison, out_dir: str) -> dict[str, str]:
    """Write compare.md, compare.csv, compare.png and, when seeds differ, compare_seeds.csv
    into `out_dir`; returns their paths."""
    texts = {"md": to_markdown(comparison), "csv": to_csv(comparison)}  # before any file opens
    groups = seed_groups(comparison)
    if groups:
        texts["seeds_csv"] = seeds_to_csv(groups, list(comparison.metric_columns))
    os.makedirs(out_dir, exist_ok=True)
    names = {"md": "compare.md", "csv": "compare.csv", "seeds_csv": "compare_seeds.csv"}
    paths = {key: os.path.join(out_dir, names[key]) for key in texts}
    for key, text in texts.items():
        with open(paths[key], "w", newline="") as f:
            f.write(text)
    paths["png"] = os.path.join(out_dir, "compare.png")
    plot(comparison, paths["png"])
    return paths


def default_out_dir(workdirs: Sequence[str]) -> str:
    """The common parent directory of the workdirs."""
    return os.path.commonpath([os.path.dirname(os.path.abspath(w)) for w in workdirs])
