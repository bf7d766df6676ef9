"""The kernel switches: defaults, environment overrides, command line choices over both."""

from __future__ import annotations

import pickle
from collections.abc import Iterator

import pytest

from turbospark.engine import kernel_settings
from turbospark.engine.kernel_settings import (
    DEFAULTS,
    ENV_VARS,
    KernelSettingError,
    KernelSettings,
    configure,
    current,
    from_environment,
    origin,
)


@pytest.fixture(autouse=True)
def clean(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """No kernel variable set and no command line choice, before and after each test."""
    for var in ENV_VARS.values():
        monkeypatch.delenv(var, raising=False)
    configure()
    yield
    configure()


def test_defaults_keep_the_behaviour_of_before() -> None:
    assert from_environment({}) == DEFAULTS == current()
    before = KernelSettings(
        cpu_kernels="auto",
        native_kernels="auto",
        native_vnni=True,
        hugepages=True,
        fast_nondeterministic=False,
        pool_steal=True,
    )
    assert before == DEFAULTS
    assert all(origin(name) == "default" for name in kernel_settings.FIELDS)


@pytest.mark.parametrize(
    ("var", "raw", "field", "value"),
    [
        ("TURBOSPARK_CPU_KERNELS", " AVX2 ", "cpu_kernels", "avx2"),
        ("TURBOSPARK_CPU_KERNELS", "bf16-native", "cpu_kernels", "bf16-native"),
        ("TURBOSPARK_CPU_KERNELS", "", "cpu_kernels", "auto"),  # empty: unset, as before
        ("TURBOSPARK_NATIVE_KERNELS", "0", "native_kernels", "off"),
        ("TURBOSPARK_NATIVE_KERNELS", "1", "native_kernels", "on"),
        ("TURBOSPARK_NATIVE_KERNELS", "yes", "native_kernels", "on"),
        ("TURBOSPARK_NATIVE_KERNELS", "auto", "native_kernels", "auto"),
        ("TURBOSPARK_NATIVE_VNNI", "0", "native_vnni", False),
        ("TURBOSPARK_NATIVE_VNNI", "1", "native_vnni", True),
        ("TURBOSPARK_HUGEPAGES", "off", "hugepages", False),
        ("TURBOSPARK_HUGEPAGES", "", "hugepages", True),
        ("TURBOSPARK_FAST_NONDETERMINISTIC", "1", "fast_nondeterministic", True),
        ("TURBOSPARK_FAST_NONDETERMINISTIC", "TRUE", "fast_nondeterministic", True),
        ("TURBOSPARK_FAST_NONDETERMINISTIC", "0", "fast_nondeterministic", False),
        ("TURBOSPARK_POOL_STEAL", "0", "pool_steal", False),
        ("TURBOSPARK_POOL_STEAL", "no", "pool_steal", False),
    ],
)
def test_each_variable_overrides_its_default(var: str, raw: str, field: str, value: object) -> None:
    settings = from_environment({var: raw})
    assert getattr(settings, field) == value
    others = [name for name in kernel_settings.FIELDS if name != field]
    assert all(getattr(settings, name) == getattr(DEFAULTS, name) for name in others)


def test_the_command_line_wins_over_the_environment_which_wins_over_the_default(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("TURBOSPARK_CPU_KERNELS", "float32")
    monkeypatch.setenv("TURBOSPARK_HUGEPAGES", "0")
    settings = configure(cpu_kernels="avx2", pool_steal=False)
    assert settings == current()
    assert settings.cpu_kernels == "avx2"  # command line over environment
    assert settings.pool_steal is False  # command line over default
    assert settings.hugepages is False  # environment over default
    assert settings.native_kernels == "auto"  # default
    assert origin("cpu_kernels") == "--cpu-kernels"
    assert origin("hugepages") == "TURBOSPARK_HUGEPAGES"
    assert origin("native_kernels") == "default"
    # an option given as False still wins over a variable saying on
    monkeypatch.setenv("TURBOSPARK_FAST_NONDETERMINISTIC", "1")
    assert configure(fast_nondeterministic=False).fast_nondeterministic is False
    assert current().cpu_kernels == "float32"  # the earlier choices are replaced, not kept
    configure()
    assert current().fast_nondeterministic is True


def test_the_environment_is_read_when_asked(monkeypatch: pytest.MonkeyPatch) -> None:
    """A variable set after start-up counts for the switches asked later (as tests do)."""
    assert current().hugepages
    monkeypatch.setenv("TURBOSPARK_HUGEPAGES", "0")
    assert not current().hugepages


@pytest.mark.parametrize(
    ("var", "raw", "allowed"),
    [
        ("TURBOSPARK_CPU_KERNELS", "fastest", "auto, avx2, float32, bf16, bf16-native"),
        ("TURBOSPARK_NATIVE_KERNELS", "sometimes", "auto, on, off"),
        ("TURBOSPARK_NATIVE_VNNI", "2", "1 / 0, on / off"),
        ("TURBOSPARK_HUGEPAGES", "always", "1 / 0, on / off"),
        ("TURBOSPARK_FAST_NONDETERMINISTIC", "fast", "1 / 0, on / off"),
        ("TURBOSPARK_POOL_STEAL", "never", "1 / 0, on / off"),
    ],
)
def test_a_bad_variable_fails_naming_it_and_its_values(
    var: str, raw: str, allowed: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    with pytest.raises(KernelSettingError) as caught:
        from_environment({var: raw})
    message = str(caught.value)
    assert var in message and repr(raw) in message and allowed in message
    assert isinstance(caught.value, ValueError)
    # configure checks the environment at once (before any model loads) and keeps what it had
    configure(hugepages=False)
    monkeypatch.setenv(var, raw)
    with pytest.raises(KernelSettingError, match=var):
        configure(cpu_kernels="avx2")
    with pytest.raises(KernelSettingError, match=var):
        current()
    monkeypatch.delenv(var)
    assert current().hugepages is False and current().cpu_kernels == "auto"


def test_a_bad_choice_names_the_option() -> None:
    with pytest.raises(KernelSettingError, match="--cpu-kernels 'fastest'"):
        configure(cpu_kernels="fastest")
    with pytest.raises(KernelSettingError, match="--native-kernels"):
        configure(native_kernels="1")


def test_a_worker_takes_the_settings_whole(monkeypatch: pytest.MonkeyPatch) -> None:
    rank0 = KernelSettings(cpu_kernels="float32", hugepages=False, pool_steal=False)
    assert pickle.loads(pickle.dumps(rank0)) == rank0  # crosses the spawn
    monkeypatch.setenv("TURBOSPARK_CPU_KERNELS", "avx2")
    kernel_settings.use_settings(rank0)
    assert current() == rank0


def test_the_modules_ask_the_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    from turbospark.engine import cpu_kernels, native, row_kernels, weight_arena
    from turbospark.engine.cpu_info import cpu_flags

    assert row_kernels.reproducible()
    configure(fast_nondeterministic=True)
    assert not row_kernels.reproducible()
    configure(hugepages=False)
    assert not weight_arena.available()
    configure(native_kernels="off")
    assert native.mode() == "off"
    assert native.unavailable_reason() == "--native-kernels turns them off"
    configure(native_vnni=False)
    assert not native.uses_vnni(frozenset({"avx512_vnni", "avx512vl"}))
    configure(cpu_kernels="float32")
    profile = cpu_kernels.detect(cpu_flags() | {"amx_bf16"})
    assert profile.source == "--cpu-kernels=float32" and not profile.packed_half
    monkeypatch.setenv("TURBOSPARK_CPU_KERNELS", "bf16")
    configure()
    assert cpu_kernels.detect(cpu_flags()).source == "TURBOSPARK_CPU_KERNELS=bf16"


def test_the_library_takes_pool_steal_as_it_loads(monkeypatch: pytest.MonkeyPatch) -> None:
    from turbospark.engine import native

    kernels = native.kernels()
    if kernels is None:
        pytest.skip("no native kernels here")
    try:
        configure(pool_steal=False)
        native._load(kernels.path, kernels.vnni)  # the same library: its state is shared
        assert kernels.lib.ts_pool_set_stealing(1) == 0
        configure()
        native._load(kernels.path, kernels.vnni)
        assert kernels.lib.ts_pool_set_stealing(1) == 1
    finally:
        kernels.lib.ts_pool_set_stealing(1)
