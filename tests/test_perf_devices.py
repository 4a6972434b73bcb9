"""Device specs: known devices, custom specs from CLI strings, typed errors, calibration cache."""

from __future__ import annotations

import json

import pytest

from fusegraph.perf.calibrate import apply_calibration, effective_spec, write_json_atomic
from fusegraph.perf.devices import (
    DEVICES,
    RATE_KEYS,
    DeviceSpecError,
    custom_spec,
    get_device,
    parse_quantity,
)
from fusegraph.settings import override


def test_every_known_device_is_complete_and_sourced() -> None:
    assert set(DEVICES) == {"H100", "H200", "A100", "B200", "L40S", "RTX4090"}
    for spec in DEVICES.values():
        assert spec.bandwidth > 1e11 and spec.l2_bytes >= 32 * 2**20 and spec.sms > 0 and spec.clock_ghz > 1
        assert spec.rate("fp32") > 0 and spec.rate("bf16") > spec.rate("fp32")
        assert "datasheet" in spec.source or "whitepaper" in spec.source
        for key, dense in spec.peak.items():
            if key in spec.sparse:
                assert spec.sparse[key] == pytest.approx(2 * dense, rel=0.02), (spec.name, key)
    assert not DEVICES["A100"].has_rate("fp8")
    assert DEVICES["H200"].bandwidth == 4.8e12 and DEVICES["B200"].rate("bf16") == 2.25e15


@pytest.mark.parametrize("text,name", [("NVIDIA H200", "H200"), ("h100", "H100"),
                                       ("NVIDIA GeForce RTX 4090", "RTX4090"), ("NVIDIA A100-SXM4-80GB", "A100"),
                                       ("l40s", "L40S"), ("B200", "B200")])
def test_names_map_to_specs(text: str, name: str) -> None:
    assert get_device(text).name == name


def test_unknown_device_lists_known_ones() -> None:
    with pytest.raises(DeviceSpecError) as info:
        get_device("X100")
    for name in DEVICES:
        assert name in str(info.value)


@pytest.mark.parametrize("text,unit,value", [("8TB/s", "B/s", 8e12), ("2.2PF", "FLOP/s", 2.2e15),
                                             ("989TFLOPS", "FLOP/s", 989e12), ("50MB", "B", 50e6),
                                             ("50MiB", "B", 50 * 2**20), ("3.35 TB/s", "B/s", 3.35e12),
                                             ("132", "", 132.0), ("2us", "us", 2.0)])
def test_parse_quantity(text: str, unit: str, value: float) -> None:
    assert parse_quantity(text, "field", unit) == pytest.approx(value)


def test_custom_spec_from_strings() -> None:
    spec = custom_spec(bandwidth="8TB/s", bf16="2.2PF")
    assert spec.bandwidth == 8e12 and spec.rate("bf16") == pytest.approx(2.2e15)
    assert spec.rate("fp16") == spec.rate("bf16") and spec.rate("fp32") > 0
    over = custom_spec("H200x", base=get_device("H200"), bandwidth="9.6TB/s")
    assert over.bandwidth == 9.6e12 and over.rate("bf16") == get_device("H200").rate("bf16")


@pytest.mark.parametrize("fields,named", [
    ({"bandwidth": "0TB/s", "bf16": "1PF"}, "bandwidth"),
    ({"bandwidth": "-3TB/s", "bf16": "1PF"}, "bandwidth"),
    ({"bandwidth": "fast", "bf16": "1PF"}, "bandwidth"),
    ({"bandwidth": "8TB/s", "bf16": "0"}, "bf16"),
    ({"bandwidth": "8TB/s", "bf16": "2.2PB/s"}, "bf16"),
    ({"bf16": "1PF"}, "bandwidth"),
    ({"bandwidth": "8TB/s"}, "peak rate"),
    ({"bandwidth": "8TB/s", "bf16": "1PF", "l2": "-1MB"}, "l2"),
    ({"bandwidth": "8TB/s", "bf16": "1PF", "warp_speed": "9"}, "warp_speed"),
])
def test_bad_custom_specs_name_the_field(fields: dict[str, str], named: str) -> None:
    with pytest.raises(DeviceSpecError) as info:
        custom_spec(**fields)
    assert named in str(info.value)


def test_rate_of_missing_dtype_is_a_typed_error() -> None:
    with pytest.raises(DeviceSpecError, match="fp8"):
        get_device("A100").rate("fp8")
    assert set(RATE_KEYS) >= set(get_device("H200").peak)


def test_measured_values_replace_datasheet_values(tmp_path) -> None:
    record = {"gpu": "NVIDIA H200", "time": "2026-11-30T00:00:00Z",
              "measured": {"bandwidth": 4.2e12, "bf16": 769e12, "fp8": 1351e12, "launch_us": 0.8,
                           "host_launch_us": 11.0}}
    write_json_atomic(tmp_path / "calibration" / "nvidia_h200.json", record)
    assert not list((tmp_path / "calibration").glob("*.tmp"))
    assert (tmp_path / "calibration" / "nvidia_h200.json").stat().st_mode & 0o777 == 0o644
    with override(cache_dir=str(tmp_path)):
        spec = effective_spec("H200")
        assert spec.bandwidth == 4.2e12 and spec.rate("bf16") == 769e12 and spec.rate("fp8") == 1351e12
        assert spec.launch_us == 0.8 and "bandwidth" in spec.measured and "measured" in spec.summary()
        assert effective_spec("H200", use_calibration=False).bandwidth == 4.8e12
        assert effective_spec("B200").bandwidth == 8e12  # another model's calibration does not apply
    direct = apply_calibration(get_device("H100"), {"measured": {"bandwidth": 3e12}})
    assert direct.bandwidth == 3e12 and direct.measured == ("bandwidth",)
    assert json.loads((tmp_path / "calibration" / "nvidia_h200.json").read_text())["gpu"] == "NVIDIA H200"
