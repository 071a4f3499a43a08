"""aisrl.bench.cli: a benchmark script refuses an option it does not know (a misspelt key would otherwise run with its
default and be recorded as set), names a subcommand only by its first argument, and records the command as run."""

import re
import runpy
import shutil
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from conftest import load_benchmark

from aisrl.bench.cli import command, flag, number, numbers, options, subcommand

BENCH = Path(__file__).parent.parent / "benchmarks"


def test_options_split_positional_arguments_from_known_keys_and_name_what_is_wrong():
    assert options(["runs/a", "steps=3", "tag=x=y"], ("steps", "tag"), positional=True) == (
        ["runs/a"], {"steps": "3", "tag": "x=y"})  # fmt: skip
    with pytest.raises(SystemExit, match=r"unknown keys \['stpes'\]; the options are key=value with keys \['steps'"):
        options(["stpes=3"], ("steps", "tag"))
    with pytest.raises(SystemExit, match=r"keys given twice \['steps'\]"):
        options(["steps=3", "steps=4"], ("steps",))
    with pytest.raises(SystemExit, match=r"arguments without '=' \['steps', '3'\][\s\S]*usage: script.py \[steps=N\]"):
        options(["steps", "3"], ("steps",), usage="script.py [steps=N]")


def test_a_subcommand_is_the_first_argument_only_and_an_unknown_one_is_an_error():
    commands = {"run": ("shapes", "out"), "publish": ("out",)}
    assert subcommand(["shapes=x"], commands) == ("run", {"shapes": "x"})  # not a subcommand 'shapes=x'
    assert subcommand([], commands) == ("run", {})
    assert subcommand(["publish", "out=o.json"], commands) == ("publish", {"out": "o.json"})
    with pytest.raises(SystemExit, match=r"unknown command 'pubish'; choose from \['run', 'publish'\]"):
        subcommand(["pubish"], commands)
    with pytest.raises(SystemExit, match=r"unknown keys \['shapes'\]"):  # publish has no shapes
        subcommand(["publish", "shapes=x"], commands)
    with pytest.raises(SystemExit, match=r"arguments without '=' \['publish'\]"):  # a command after an option
        subcommand(["shapes=x", "publish"], commands)


def test_the_recorded_command_carries_the_thread_setting_it_ran_with(tmp_path, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert command("/x/benchmarks/a.py", ["steps=1"]) == "OMP_NUM_THREADS=3 python benchmarks/a.py steps=1"
    monkeypatch.delenv("OMP_NUM_THREADS")
    monkeypatch.setattr(sys, "argv", ["a.py", "tag=a"])
    assert command("a.py") == "python benchmarks/a.py tag=a"
    # an argument a shell would split is quoted, so the line runs again (before: strengths=[0.05, 0.2] bare)
    assert command("a.py", ["strengths=[0.05, 0.2]", "start=my runs/x:5"]) == (
        "python benchmarks/a.py 'strengths=[0.05, 0.2]' 'start=my runs/x:5'")
    # the two scripts that wrote OMP_NUM_THREADS=2 into their command whatever the run's setting (the measurements
    # themselves are left out: a pull that changes nothing, a study of no runs)
    cp, cm = load_benchmark("copy_pull"), load_benchmark("checkpoint_mismatch")
    curve = [{"step": 0, "k3": 0.1, "reward": 0.5, "nll": 1.0}]
    monkeypatch.setattr(cp, "pull", lambda preset, quant, start, v, lr, *a: {"variant": v, "lr": lr, "curve": curve})
    monkeypatch.setattr(cm, "setup", lambda *a: SimpleNamespace(measure=lambda held: curve[0]))
    for mod in (cp, cm):
        monkeypatch.setattr(mod, "ROOT", tmp_path)
    monkeypatch.setattr(sys, "argv", ["x.py", "tag=t"])
    for threads in ("1", None):
        if threads:
            monkeypatch.setenv("OMP_NUM_THREADS", threads)
        else:
            monkeypatch.delenv("OMP_NUM_THREADS")
        env = f"OMP_NUM_THREADS={threads} " if threads else ""
        out = cp.main("lab", "mxfp4_w4a4", "", ["grid"], [1e-3], 1, 1, 1, "t")
        assert out["command"] == f"{env}python benchmarks/copy_pull.py tag=t"
        out = cm.main([tmp_path], [], [1], "mxfp4_w4a4", "lab", 1, "t")
        assert out["command"] == f"{env}python benchmarks/checkpoint_mismatch.py tag=t"
        assert f"`{out['command']}`" in (tmp_path / "BENCHMARKS.md").read_text()


# Each script with a misspelt key and a value that fails fast: the key must be refused before anything runs (before
# the check, the scripts dropped it and stopped only at the bad value, or, without one, ran a whole study).
SCRIPTS = [
    ("mismatch_vs_gap", ["nowhere", "steps=x"], "metric"),
    ("checkpoint_mismatch", ["nowhere", "held=x"], "kinds"),
    ("copy_pull", ["lrs=x"], "variants"),
    ("first_step_gradients", ["below=x"], "seeds"),
    ("gpu_grpo", ["steps=x"], "variants"),
    ("gpu_rollout", ["run", "batches=x"], "shapes"),
    ("calibration_noise", ["nowhere", "steps=x"], "tag"),
    ("ais_tis_paths", ["steps=x"], "quant"),
    ("gradient_bias", ["salts=x"], "horizons"),
    ("paired_seeds", ["nowhere", "steps=x"], "overwrite"),
]


@pytest.mark.parametrize(("script", "args", "valid"), SCRIPTS, ids=[s[0] for s in SCRIPTS])
def test_every_script_refuses_a_misspelt_key_naming_it_and_the_valid_ones(script, args, valid, tmp_path, monkeypatch):
    with pytest.raises(SystemExit, match=rf"unknown keys \['bogus'\]; the options are key=value with keys .*'{valid}'"):
        run_copy(script, [*args, "bogus=1"], tmp_path, monkeypatch)


def run_copy(script: str, args: list[str], tmp_path: Path, monkeypatch) -> None:
    """Run benchmarks/`script`.py as a command with `args`, from a copy of the folder under tmp_path: a script that
    failed to refuse its arguments writes its results there, not into the repository (a first version of the test
    below published a measurement of `correction_cost.py 0` that way)."""
    (tmp_path / "benchmarks").mkdir()
    for f in BENCH.glob("*.py"):
        shutil.copy(f, tmp_path / "benchmarks" / f.name)
    path = tmp_path / "benchmarks" / f"{script}.py"
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", [str(path), *args])
    monkeypatch.setattr(sys, "path", list(sys.path))  # the scripts that import a sibling add their folder
    runpy.run_path(str(path), run_name="__main__")


def test_numeric_options_are_read_with_their_type_and_a_bad_value_names_the_key():
    kw = {"steps": "3", "lr": "1e-3", "seeds": "0, 1,2", "bad": "ten", "half": "2.5", "nan": "nan", "neg": "-1"}
    assert number(kw, "steps", 9) == 3 and number(kw, "absent", 9) == 9 and number(kw, "absent", None) is None
    assert number(kw, "lr", 0.0, float) == 1e-3 and number(kw, "steps", 0.0, float) == 3.0
    assert numbers(kw, "seeds", [7]) == [0, 1, 2] and numbers(kw, "absent", [7, 8]) == [7, 8]
    for key, kind, low, message in (("bad", int, None, "give an integer"), ("half", int, None, "give an integer"),
                                    ("bad", float, None, "give a number"), ("nan", float, None, "give a finite"),
                                    ("neg", int, 0, "give a value of at least 0")):  # fmt: skip
        with pytest.raises(SystemExit, match=rf"^{key}='{kw[key]}': {message}"):
            number(kw, key, None, kind, low)
    with pytest.raises(SystemExit, match=r"^seeds='0,x' \(entry 'x'\): give an integer"):
        numbers({"seeds": "0,x"}, "seeds", [])
    with pytest.raises(SystemExit, match=r"^seeds='0,-2' \(entry '-2'\): give a value of at least 0"):
        numbers({"seeds": "0,-2"}, "seeds", [], low=0)
    with pytest.raises(SystemExit, match=r"^seeds=',': give one or more ints separated by commas"):
        numbers({"seeds": ","}, "seeds", [])


# Each script with a value of the wrong type: a clear exit naming the key (before: a ValueError traceback, or for
# the two TRL scripts and correction_cost a step count of 0 that failed later).
BAD_VALUES = [
    ("mismatch_vs_gap", ["nowhere", "steps=x"], "steps='x'"),
    ("checkpoint_mismatch", ["nowhere", "held=x"], "held='x'"),
    ("checkpoint_mismatch", ["nowhere", "steps=80,y"], "steps='80,y'"),
    ("copy_pull", ["lrs=x"], "lrs='x'"),
    ("copy_pull", ["every=0"], "every='0'"),
    ("first_step_gradients", ["below=x"], "below='x'"),
    ("first_step_gradients", ["below=0"], "below=0.0: the weight threshold is above 0"),
    ("gpu_grpo", ["steps=2.5"], "steps='2.5'"),
    ("gpu_rollout", ["run", "batches=x"], "batches='x'"),
    ("calibration_noise", ["nowhere", "steps=x"], "steps='x'"),
    ("ais_tis_paths", ["seed=-1"], "seed='-1'"),
    ("gradient_bias", ["salts=x"], "salts='x'"),
    ("paired_seeds", ["nowhere", "steps=x"], "steps='x'"),
    ("guard_study", ["a", "b", "fall=x"], "fall='x'"),
    ("guard_replay", ["nowhere", "window=x"], "window='x'"),
    ("guard_replay", ["nowhere", "factor=0.5"], "factor=0.5: the jump guard's factor is above 1"),
    ("guard_replay", ["nowhere", "drift=0"], "drift=0.0: the drift ratio is above 0"),
    ("guard_replay", ["nowhere", "fall=8"], "fall=8.0: a drop of held-out accuracy in (0, 1]"),
    ("guard_study", ["a", "b", "fall=0"], "fall=0.0: a drop of held-out accuracy in (0, 1]"),
    ("trl_overhead", ["0"], "usage: python benchmarks/trl_overhead.py"),
    ("trl_step_time", ["two"], "usage: python benchmarks/trl_step_time.py"),
    ("correction_cost", ["0"], "usage: python benchmarks/correction_cost.py"),
]


@pytest.mark.parametrize(("script", "args", "named"), BAD_VALUES, ids=[f"{s[0]}-{s[1][-1]}" for s in BAD_VALUES])
def test_every_script_refuses_a_value_of_the_wrong_type_naming_the_key(script, args, named, tmp_path, monkeypatch):
    with pytest.raises(SystemExit, match=re.escape(named)):
        run_copy(script, args, tmp_path, monkeypatch)


def test_smoke_runs_of_the_published_benchmarks_keep_names_of_their_own():
    # before, a run of correction_cost.py or mismatch.py at any size replaced the figures BENCHMARKS.md publishes
    cost = load_benchmark("correction_cost")
    assert cost.name(512, 1024) == "correction_cost" and cost.name(64, 32) == "correction_cost_N64_T32"
    mm = load_benchmark("mismatch")
    from aisrl.doctor import DoctorConfig

    def of(subject, preset="", **changes):
        changes.setdefault("formats", mm.default_formats(preset))  # the script's defaults
        return mm.tagged(DoctorConfig(model="smollm2", preset=preset, **changes), subject)

    # the commands BENCHMARKS.md gives keep their sections
    assert of("smollm2") == "smollm2"
    assert of("lab", "lab", prompts=64) == "lab" and of("lab_columns", "lab_columns", prompts=256) == "lab_columns"
    assert of("diffusion_lab", "diffusion_lab", prompts=64) == "diffusion_lab"
    # a diffusion model has no KV cache, which the doctor refuses to measure: its default leaves the _kv presets out
    assert "fp8_e4m3_w8a8_kv" in mm.default_formats("lab") and "fp8_e4m3_w8a8_kv" not in mm.default_formats(
        "diffusion_lab")  # fmt: skip
    from aisrl.doctor import check

    check(DoctorConfig(preset="diffusion_lab", formats=mm.default_formats("diffusion_lab")))  # the published command
    smoke = of("smollm2", prompts=2, max_new_tokens=4)
    assert smoke.startswith("smollm2_") and len(smoke) == len("smollm2_") + 8
    assert of("smollm2", max_new_tokens=4, prompts=2) == smoke  # stable
    assert of("lab", "lab", prompts=8) not in ("lab", smoke) and of("lab", "lab").startswith("lab_")
    assert of("smollm2", formats=["int4"]).startswith("smollm2_")


def test_a_choice_and_a_folder_that_are_not_there_are_named(tmp_path):
    from aisrl.bench.cli import choice, study_folders

    assert choice({}, "metric", "reward", ["reward", "held_accuracy"]) == "reward"
    assert choice({"metric": "held_accuracy"}, "metric", "reward", ["reward", "held_accuracy"]) == "held_accuracy"
    with pytest.raises(SystemExit, match=r"metric='greedy': choose from \['held_accuracy', 'reward'\]"):
        choice({"metric": "greedy"}, "metric", "reward", ["reward", "held_accuracy"])  # was a traceback
    assert study_folders([str(tmp_path)]) == [tmp_path]
    with pytest.raises(SystemExit, match=r"no such folder: \['.*nowhere'\]"):
        study_folders([tmp_path, tmp_path / "nowhere"])
    with pytest.raises(SystemExit, match=r"no such folder: \[\]"):
        study_folders([])


# Found by mutation testing: each case below failed a plausible slip that the tests above let pass.

def test_flags():
    assert flag({"x": "yes"}, "x", False) is True and flag({"x": "TRUE"}, "x", False) is True


def test_minus_infinity_is_refused():
    with pytest.raises(SystemExit, match="give a finite number"):
        number({"lr": "-inf"}, "lr", None, float)


def test_the_default_list_is_a_copy():
    default = [7]
    got = numbers({}, "seeds", default)
    got.append(8)
    assert default == [7] and numbers({}, "seeds", (1, 2)) == [1, 2]
