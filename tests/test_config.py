import typing
from dataclasses import asdict, dataclass, field

import pytest
import torch

from aisrl.config import apply_mapping, apply_overrides, field_docs


@dataclass
class Inner:
    cap: float = 2.0
    """doc"""
    name: str = "ais"


@dataclass
class Cfg:
    seed: int = 0
    steps: list[float] = field(default_factory=lambda: [0.1])
    flag: bool = False
    opt: float | None = None
    inner: Inner = field(default_factory=Inner)


def test_typed_overrides():
    cfg = apply_overrides(Cfg(), ["seed=3", "steps=[1, 2.5]", "flag=true", "inner.cap=4", "inner.name=tis", "opt=none"])
    assert cfg.seed == 3 and cfg.steps == [1.0, 2.5] and cfg.flag is True and cfg.opt is None
    assert cfg.inner.cap == 4.0 and isinstance(cfg.inner.cap, float) and cfg.inner.name == "tis"
    assert apply_overrides(Cfg(), ["opt=0.5"]).opt == 0.5


@pytest.mark.parametrize(
    "item,message",
    [
        ("sed=1", r"unknown config key 'sed' \(did you mean 'seed'\?\); valid keys here: "
                  r"\['flag', 'inner', 'opt', 'seed', 'steps'\]"),
        ("inner.capp=1", r"unknown config key 'inner.capp'"),
        ("nope.cap=1", r"'nope' is not one of"),
        ("seed=ten", r"config key 'seed' expects int, got 'ten'"),
        ("seed=1.5", r"config key 'seed' expects int"),
        ("steps=3", r"config key 'steps' expects a list"),
        ("inner=3", r"'inner' is a section"),
        ("seed.x=1", r"config key 'seed.x': the part before 'x' is a value, not a section"),
        ("seed", r"must look like key=value"),
    ],
)
def test_bad_overrides_name_the_key(item, message):
    with pytest.raises(ValueError, match=message):
        apply_overrides(Cfg(), [item])


def test_strings_stay_strings_and_lists_accept_bare_items():
    @dataclass
    class C:
        name: str = "ais"
        methods: list[str] = field(default_factory=list)
        label: str | None = "x"

    cfg = apply_overrides(C(), ["name=none", "methods=[none, tis ,ais]", "label=none"])
    assert cfg.name == "none" and cfg.methods == ["none", "tis", "ais"] and cfg.label is None
    assert apply_overrides(C(), ["methods=['a', 'b']", "name='1'"]).methods == ["a", "b"]
    assert apply_overrides(C(), ["name='1'"]).name == "1"
    # bare items split at the top-level commas only: a quoted item or a bracketed one keeps its commas (before:
    # `"task_options={'a':1,'b':2}"` was cut in two, and an unknown-key error named half of it)
    both = apply_overrides(C(), ['methods=["opts={\'a\':1,\'b\':2}",steps=2]'])
    assert both.methods == ["opts={'a':1,'b':2}", "steps=2"]
    assert apply_overrides(C(), ["methods=[keep=[a,b],steps=2]"]).methods == ["keep=[a,b]", "steps=2"]
    with pytest.raises(ValueError, match=r"config key 'methods': \[a, \[b\] has an unclosed"):
        apply_overrides(C(), ["methods=[a, [b]"])


def test_a_list_of_integers_takes_a_span():
    @dataclass
    class Study:
        seeds: list[int] = field(default_factory=list)
        rates: list[float] = field(default_factory=list)

    assert apply_overrides(Study(), ["seeds=[3,...,7]"]).seeds == [3, 4, 5, 6, 7]
    assert apply_overrides(Study(), ["seeds=[ 42, ..., 42 ]"]).seeds == [42]
    with pytest.raises(ValueError, match=r"\[9,...,2\] runs backwards"):
        apply_overrides(Study(), ["seeds=[9,...,2]"])
    with pytest.raises(ValueError, match=r"seeds\[2\]' expects int"):  # only a first and a last around the dots
        apply_overrides(Study(), ["seeds=[1,2,...,5]"])
    with pytest.raises(ValueError, match=r"rates\[1\]' expects float"):  # integers only
        apply_overrides(Study(), ["rates=[1,...,5]"])


@dataclass
class Pair:
    band: tuple[float, float] = (0.1, 0.7)
    names: tuple[str, ...] = ("a",)


def test_tuples_are_fixed_length_and_typed():
    cfg = apply_overrides(Pair(), ["band=[1, 0.5]", "names=[x,y,z]"])
    assert cfg.band == (1.0, 0.5) and isinstance(cfg.band, tuple) and cfg.names == ("x", "y", "z")
    for item, message in [("band=[0.1]", "expects 2 items"), ("band=[0.1,0.2,0.3]", "expects 2 items"),
                          ("band=0.3", "expects 2 items"), ("band=[a,0.2]", r"'band\[0\]' expects float")]:  # fmt: skip
        with pytest.raises(ValueError, match=message):
            apply_overrides(Pair(), [item])


def test_yaml_mappings_keep_their_types_and_are_checked_like_overrides(tmp_path):
    yaml = pytest.importorskip("yaml")
    from aisrl.train_config import load_config

    text = "lr: 1e-4\nseed: 3\nlab: {ops: 'it''s \\\\ x', target: [0.4, 0.9]}\n"  # YAML: '' is a quote
    data = yaml.safe_load(text)
    assert data["lr"] == "1e-4"  # YAML 1.1 reads an exponent without a dot as text
    cfg = apply_mapping(Cfg(), {"seed": 3, "opt": "1e-4", "inner": {"cap": 4, "name": "tis"}})
    assert cfg.seed == 3 and cfg.opt == 1e-4 and cfg.inner.cap == 4.0 and cfg.inner.name == "tis"
    preset = tmp_path / "p.yaml"
    preset.write_text(text)
    cfg = load_config(str(preset))
    assert cfg.lr == 1e-4 and cfg.seed == 3 and cfg.lab.ops == "it's \\\\ x" and cfg.lab.target == (0.4, 0.9)
    preset.write_text("lab: {target: [4e-1, 9e-1]}\n")  # exponents inside a list are text to YAML 1.1 too
    assert yaml.safe_load(preset.read_text())["lab"]["target"] == ["4e-1", "9e-1"]
    assert load_config(str(preset)).lab.target == (0.4, 0.9)
    assert apply_mapping(Cfg(), {"steps": ["1e-3", 2]}).steps == [1e-3, 2.0]
    for text, message in [("dataset: null", "'dataset' expects str, got None"),
                          ("rollout: {quant: off}", "'rollout.quant' expects str, got False"),
                          ("output_dir: 5", "'output_dir' expects str, got 5"),
                          ("rollout: 3", "section 'rollout' must be a mapping"),
                          ("rollout: {quantt: none}", "unknown config key 'rollout.quantt'"),
                          ("seed: 1.5", "'seed' expects int"),
                          ("lab: {target: [4e-1, 9e-1, 1e-1]}", r"'lab.target' expects .* got \[0.4, 0.9, 0.1\]"),
                          ("lab: {target: [4e-1, abc]}", "'lab.target' expects"),
                          ("seed: 1\nlr: 0.1\nseed: 2", r"key 'seed' is given twice \(line 3\); keep one"),
                          ("lab: {ops: '+', ops: '-'}", "key 'ops' is given twice")]:  # fmt: skip
        preset.write_text(text + "\n")
        with pytest.raises(ValueError, match=message):
            load_config(str(preset))
    # YAML merge keys are YAML: a shared block merged in, and overridden where the mapping says so
    preset.write_text("base: &b {temperature: 0.7, max_new_tokens: 9}\n")
    with pytest.raises(ValueError, match="unknown config key 'base'"):  # the anchor must live somewhere known
        load_config(str(preset))
    preset.write_text("rollout:\n  <<: {temperature: 0.7, max_new_tokens: 9}\n  max_new_tokens: 8\n")
    cfg = load_config(str(preset))
    assert cfg.rollout.temperature == 0.7 and cfg.rollout.max_new_tokens == 8
    preset.write_bytes(b"\xff\xfeseed: 3\n")  # UTF-16 from a Windows editor, say
    with pytest.raises(ValueError, match=r"p\.yaml is not UTF-8 text .*at byte 0\): save it as UTF-8"):
        load_config(str(preset))


def test_a_recorded_config_json_reads_back_exactly(tmp_path):
    import json

    from aisrl.train_config import load_config

    cfg = load_config(None, ["task_options={'x': {'y': 1e-05}}", "lr=3e-5"])
    path = tmp_path / "config.json"
    path.write_text(json.dumps(asdict(cfg)))
    back = load_config(str(path))
    assert asdict(back) == asdict(cfg) and back.task_options == {"x": {"y": 1e-05}}
    path.write_text("{not json")
    with pytest.raises(ValueError, match="config.json is not valid JSON"):
        load_config(str(path))


def test_mapping_fields_take_dicts_with_text_keys(tmp_path):
    yaml = pytest.importorskip("yaml")
    from aisrl.train_config import load_config

    @dataclass
    class WithMap:
        extra: dict[str, typing.Any] = field(default_factory=dict)

    assert apply_overrides(WithMap(), ["extra={'low': 0.8, 'name': 'x'}"]).extra == {"low": 0.8, "name": "x"}
    for item in ["extra=low", "extra=[1, 2]", "extra={1: 2}"]:
        with pytest.raises(ValueError, match="config key 'extra' expects a mapping with text keys"):
            apply_overrides(WithMap(), [item])
    preset = tmp_path / "p.yaml"  # YAML 1.1 reads 1e-3 as text; in a mapping of free values it is a number again
    preset.write_text("correction: {name: k3_reject, options: {threshold: 1e-3, level: seq_max}}\n")
    assert yaml.safe_load(preset.read_text())["correction"]["options"]["threshold"] == "1e-3"
    assert load_config(str(preset)).correction.options == {"threshold": 1e-3, "level": "seq_max"}


def test_field_docs_flatten_sections_and_read_the_string_under_each_field():
    docs = field_docs(Cfg)
    assert list(docs) == ["seed", "steps", "flag", "opt", "inner.cap", "inner.name"]
    assert docs["inner.cap"] == (2.0, "doc") and docs["inner.name"] == ("ais", "")  # no string under it: no doc
    assert docs["steps"] == ([0.1], "")


def test_every_training_and_study_key_is_documented():
    from aisrl.branch import BranchConfig
    from aisrl.compare import CompareConfig
    from aisrl.train_config import TrainConfig

    for cls in (TrainConfig, CompareConfig, BranchConfig):
        undocumented = [k for k, (_, doc) in field_docs(cls).items() if not doc]
        assert not undocumented, f"{cls.__name__}: {undocumented}"
    assert field_docs(TrainConfig)["rollout.quant"][0] == "fp8_e4m3_w8a8"


def test_more_torchrun_ranks_than_gpus_is_refused_with_the_process_count_to_use(monkeypatch):
    from aisrl.train_config import resolve_device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setenv("LOCAL_RANK", "0")
    assert resolve_device("auto") == torch.device("cuda:0")  # rank 0 takes the GPU
    monkeypatch.setenv("LOCAL_RANK", "1")  # before: "device 'cuda:1' asked for ...; use device=cpu (or auto)"
    with pytest.raises(ValueError, match=r"LOCAL_RANK=1 trains on cuda:1, but this machine has 1 CUDA devices; "
                                         r"start at most 1 processes per node \(--nproc_per_node=1\)"):  # fmt: skip
        resolve_device("auto")
    assert resolve_device("cpu") == torch.device("cpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    with pytest.raises(ValueError, match=r"device 'cuda:1' asked for, but this machine has 0 CUDA devices"):
        resolve_device("cuda")
    assert resolve_device("auto") == torch.device("cpu")
    # one explicit GPU for every torchrun process (before: all ranks on cuda:1, NCCL's duplicate-GPU failure later)
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ValueError, match="device=cuda:1 names one GPU for every torchrun process; use device=cuda"):
        resolve_device("cuda:1")
    monkeypatch.setenv("WORLD_SIZE", "1")
    with pytest.raises(ValueError, match=r"device 'cuda:1' asked for, but this machine has 0"):  # a single process
        resolve_device("cuda:1")


def test_a_yaml_nan_is_refused_as_on_the_command_line(tmp_path):
    from aisrl.train_config import load_config

    preset = tmp_path / "p.yaml"
    preset.write_text("dual_clip: nan\n")  # text: before, read as float('nan'), which passed every check
    with pytest.raises(ValueError, match="config key 'dual_clip' expects float, got 'nan'"):
        load_config(str(preset), [])
    for text in ("dual_clip: .nan\n", "lr: .inf\n", "correction: {guard: .nan}\n"):  # YAML's own: floats
        preset.write_text(text)  # (before: lr=inf passed validate, and a NaN guard was silently off)
        with pytest.raises(ValueError, match=r"config key '(dual_clip|lr|correction.guard)' must be a finite number"):
            load_config(str(preset), [])
    with pytest.raises(ValueError, match="config key 'kl_coef' must be a finite number, got inf"):
        load_config("lab", ["kl_coef=1e999"])  # a number literal_eval reads as inf
    with pytest.raises(ValueError, match="config key 'kl_coef' must be a finite number, got 1000000"):
        load_config("lab", ["kl_coef=1" + "0" * 400])  # an integer past float's range (before: OverflowError)
    preset.write_text("lr: 1e-3\n")  # YAML 1.1 leaves this a string: still read as the number
    assert load_config(str(preset), []).lr == 1e-3


@dataclass
class Wide:
    """Field types the shipped configs use beyond Cfg's (each checked by a case below that a plausible slip in
    aisrl.config passed: found by mutation testing)."""

    seed: int = 0
    steps: list[float] = field(default_factory=lambda: [0.1])
    flag: bool = False
    opt: float | None = None
    label: str | None = "x"
    methods: list[str] = field(default_factory=list)
    seeds: list[int] = field(default_factory=list)
    extra: dict[str, typing.Any] = field(default_factory=dict)
    either: str | float = ""
    inner: Inner = field(default_factory=Inner)


def test_override_text_is_read_as_a_user_would_write_it():
    cfg = apply_overrides(Wide(), ["flag=TRUE", "steps=(1, 2.5)", "seed= 3", "inner.name= tis ", "seeds=[-2,...,1]",
                                   "opt=null", "label=null"])  # fmt: skip
    assert cfg.flag is True and cfg.steps == [1.0, 2.5] and cfg.seed == 3 and cfg.inner.name == "tis"
    assert cfg.seeds == [-2, -1, 0, 1] and cfg.opt is None and cfg.label is None
    assert apply_overrides(Wide(), ["label=1"]).label == "1"  # an optional text stays text
    assert apply_overrides(Wide(), ["inner.name='"]).inner.name == "'"  # one quote is no quoted string
    for item, message in [("inner.cap=true", "config key 'inner.cap' expects float, got True"),
                          ("seed=true", "config key 'seed' expects int, got True"),
                          ("methods=[a], [b]", "unclosed or unbalanced"),
                          ("methods=[a, 'b]", r"config key 'methods': \[a, 'b\] has an unclosed")]:  # fmt: skip
        with pytest.raises(ValueError, match=message):
            apply_overrides(Wide(), [item])


def test_mappings_read_exponents_where_a_float_goes_and_name_a_bad_section():
    from aisrl.train_config import TrainConfig

    assert apply_mapping(Cfg(), {"opt": "1E-3"}).opt == 0.001  # a float field takes a float written as text
    # free values keep their text at any depth: '1e5' may be a tag, and a run's config.json must read back exactly
    free = {"t": "1E-3", "u": {"v": "1e-5"}, "w": ["1e-3", "x"]}
    assert apply_mapping(Wide(), {"extra": free}).extra == free
    assert apply_mapping(Wide(), {"either": "1e-3"}).either == "1e-3"  # text is one of its types: kept
    with pytest.raises(ValueError, match=r"config section 'rollout' must be a mapping, got \[1\]"):
        apply_mapping(TrainConfig(), {"rollout": [1]})


def test_option_checks_and_field_docs_by_hand():
    from aisrl.config import check_like_default
    from aisrl.train_config import TrainConfig

    check_like_default("task", "floor", 1, 0.5)  # an int passes for a float
    with pytest.raises(ValueError, match=r"task option 'flag' expects bool \(default False\), got 1"):
        check_like_default("task", "flag", 1, False)
    doc = field_docs(TrainConfig)["model.name"][1]
    assert "repository id already" in doc and "\n" not in doc  # a docstring's lines joined

    @dataclass
    class Mid:
        inner: Inner = field(default_factory=Inner)

    @dataclass
    class Outer:
        mid: Mid = field(default_factory=Mid)

    assert list(field_docs(Outer)) == ["mid.inner.cap", "mid.inner.name"]


def test_override_text_a_user_might_type_is_read_or_refused_by_name():
    """Cases found by review: JSON's words inside a literal, a `#` the shell passes on, a span with a slipped digit,
    a dotted key into a mapping, a near-miss key."""
    cfg = apply_overrides(Wide(), ["extra={'a': true, 'b': [null, FALSE], 'c': 'true'}"])
    assert cfg.extra == {"a": True, "b": [None, False], "c": "true"}  # text in quotes stays text
    for item, message in [
            ("opt=1e-5#c", r"config key 'opt' expects .*got '1e-5#c'"),  # before: 1e-05, the tail dropped
            ("seed=3 # three", "config key 'seed' expects int, got '3 # three'"),
            ("seeds=[0,...,100000]", r"'seeds': \[0,...,100000\] holds 100001 values, past the 100000 a span may give"),
            ("extra.a=1", "config key 'extra.a': extra is a mapping, given whole: \"extra={'a': ...}\""),
            ("extra.a.b=1", "extra is a mapping, given whole: \"extra={'a': ...}\""),
            ("sed=1", r"unknown config key 'sed' \(did you mean 'seed'\?\)"),
            ("innr.cap=1", r"'innr' \(did you mean 'inner'\?\) is not one of")]:  # fmt: skip
        with pytest.raises(ValueError, match=message):
            apply_overrides(Wide(), [item])
    assert apply_overrides(Wide(), ["seeds=[1,...,100000]"]).seeds[-1] == 100000  # the most a span gives
    assert apply_overrides(Wide(), ["label=a#b"]).label == "a#b"  # text may hold '#'
    assert apply_overrides(Wide(), ["extra={'tag': 'a#b'}"]).extra == {"tag": "a#b"}
