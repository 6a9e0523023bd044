"""Unit tests of the profile DB: round trip, lookups, merge, and bad-input messages."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hetplan.cost_models.profile_db import (
    PROFILE_SCHEMA_VERSION,
    CollectiveRecord,
    CollectiveSample,
    CompressorRecord,
    CompressorSample,
    ComputeRecord,
    MachineInfo,
    ProfileDB,
    merge,
)
from hetplan.errors import PlanVersionError, SpecError


def _compute(
    sig: str, dev: str = "A100-80GB", samples: int = 10, fwd: float = 1.0
) -> ComputeRecord:
    return ComputeRecord(signature=sig, device_type=dev, fwd_ms=fwd, bwd_ms=2 * fwd,
                         samples=samples, fwd_stdev_ms=0.01, bwd_stdev_ms=0.02)


def _coll(n: int = 8, points: int = 3, backend: str = "nccl") -> CollectiveRecord:
    samples = tuple(CollectiveSample(nbytes=10**k, seconds=1e-5 + 1e-10 * 10**k)
                    for k in range(3, 3 + points))
    return CollectiveRecord(collective="allreduce", backend=backend, link_kind="nvlink",
                            group_size=n, samples=samples)


def _comp(name: str = "topk", points: int = 2, kind: str = "gpu") -> CompressorRecord:
    samples = tuple(CompressorSample(nbytes=2**(20 + i), compress_s=1e-4 * (i + 1),
                                     decompress_s=5e-5 * (i + 1)) for i in range(points))
    return CompressorRecord(compressor=name, device_kind=kind,  # type: ignore[arg-type]
                            device_type="A100-80GB", samples=samples)


def _db(**kw: object) -> ProfileDB:
    base: dict[str, object] = {
        "machines": (MachineInfo(device_type="A100-80GB", torch_version="2.5.1", backend="nccl",
                                 cuda_version="12.4", device_count=8),),
        "compute": (_compute("b"), _compute("a")),
        "collectives": (_coll(8), _coll(4)),
        "compressors": (_comp("topk"), _comp("dgc")),
    }
    base.update(kw)
    return ProfileDB(**base)  # type: ignore[arg-type]


# -- round trip and determinism -----------------------------------------------------------
def test_round_trip_is_byte_identical(tmp_path: Path) -> None:
    db = _db()
    first = tmp_path / "a.json"
    db.save(first)
    loaded = ProfileDB.load(first)
    assert loaded == db
    second = tmp_path / "b.json"
    loaded.save(second)
    assert first.read_bytes() == second.read_bytes()


def test_order_of_records_does_not_change_the_file() -> None:
    a = _db(compute=(_compute("a"), _compute("b")), collectives=(_coll(4), _coll(8)))
    b = _db(compute=(_compute("b"), _compute("a")), collectives=(_coll(8), _coll(4)))
    assert a.to_json() == b.to_json()
    assert [r.signature for r in b.compute] == ["a", "b"]


def test_json_has_sorted_keys_and_version() -> None:
    data = json.loads(_db().to_json())
    assert data["schema_version"] == PROFILE_SCHEMA_VERSION == 2
    assert list(data) == sorted(data)


def test_compressor_samples_sorted_by_size() -> None:
    rec = CompressorRecord(compressor="topk", device_kind="gpu", device_type="x", samples=(
        CompressorSample(nbytes=200, compress_s=2.0, decompress_s=1.0),
        CompressorSample(nbytes=100, compress_s=1.0, decompress_s=0.5),
    ))
    assert [s.nbytes for s in rec.samples] == [100, 200]


# -- lookups --------------------------------------------------------------------------------
def test_lookups_hit_and_miss() -> None:
    db = _db()
    rec = db.compute_record("a", "A100-80GB")
    assert rec is not None and rec.bwd_ms == 2.0
    assert db.compute_record("a", "V100-SXM2-32GB") is None
    assert db.compute_record("zzz", "A100-80GB") is None
    coll = db.collective("allreduce", "nccl", "nvlink", 8)
    assert coll is not None and coll.group_size == 8
    assert db.collective("allreduce", "nccl", "nvlink", 16) is None
    assert db.collective("allreduce", "gloo", "nvlink", 8) is None
    assert [r.group_size for r in db.collective_records("allreduce", "nccl", "nvlink")] == [4, 8]
    assert db.compressor("topk", "gpu", "A100-80GB") is not None
    assert db.compressor("topk", "cpu", "A100-80GB") is None
    assert ProfileDB().compressor("topk", "gpu", "A100-80GB") is None


# -- merge ----------------------------------------------------------------------------------
def test_merge_unites_and_keeps_record_with_more_samples() -> None:
    a = ProfileDB(
        machines=(MachineInfo(device_type="A100-80GB", torch_version="2.5", backend="nccl"),),
        compute=(_compute("x", samples=10, fwd=1.0), _compute("only-a")),
        collectives=(_coll(8, points=2),),
    )
    b = ProfileDB(
        machines=(MachineInfo(device_type="V100-SXM2-32GB", torch_version="2.5",
                              backend="nccl"),),
        compute=(_compute("x", samples=50, fwd=9.0), _compute("only-b")),
        collectives=(_coll(8, points=4),),
        compressors=(_comp(),),
    )
    m = merge(a, b)
    assert {r.signature for r in m.compute} == {"x", "only-a", "only-b"}
    x = m.compute_record("x", "A100-80GB")
    assert x is not None and x.fwd_ms == 9.0 and x.samples == 50
    coll = m.collective("allreduce", "nccl", "nvlink", 8)
    assert coll is not None and len(coll.samples) == 4
    assert len(m.compressors) == 1
    assert [mi.device_type for mi in m.machines] == ["A100-80GB", "V100-SXM2-32GB"]
    assert merge(a, b) == merge(b, a)  # no ties here, so order does not matter


def test_merge_tie_keeps_first_argument() -> None:
    a = ProfileDB(compute=(_compute("x", samples=10, fwd=1.0),))
    b = ProfileDB(compute=(_compute("x", samples=10, fwd=2.0),))
    assert merge(a, b).compute[0].fwd_ms == 1.0
    assert merge(b, a).compute[0].fwd_ms == 2.0


def test_merge_same_machine_twice_is_deduplicated() -> None:
    db = _db()
    merged = merge(db, db)
    assert merged.machines == db.machines
    assert merged == db
    assert merge() == ProfileDB()


# -- bad input ------------------------------------------------------------------------------
def _write(tmp_path: Path, data: object, name: str = "p.json") -> Path:
    path = tmp_path / name
    path.write_text(json.dumps(data) if not isinstance(data, str) else data)
    return path


def test_other_schema_version_is_refused(tmp_path: Path) -> None:
    data = json.loads(_db().to_json())
    data["schema_version"] = 3
    with pytest.raises(PlanVersionError) as e:
        ProfileDB.load(_write(tmp_path, data))
    msg = str(e.value)
    assert "profile DB schema_version 3; this hetplan reads 2; re-run `hetplan profile`" in msg
    assert "p.json" in msg


def test_version_1_is_refused_with_the_reason(tmp_path: Path) -> None:
    data = {"schema_version": 1, "compute": []}
    with pytest.raises(PlanVersionError, match="batch-specific signatures"):
        ProfileDB.load(_write(tmp_path, data))


def _rec(batch: int, fwd: float, dtype: str = "fp32") -> ComputeRecord:
    return ComputeRecord(signature="s", device_type="gpu", dtype=dtype,  # type: ignore[arg-type]
                         batch_size=batch, fwd_ms=fwd, bwd_ms=2 * fwd, samples=1)


def test_compute_record_takes_the_nearest_batch_in_the_asked_dtype() -> None:
    db = ProfileDB(compute=(_rec(1, 1.0), _rec(8, 5.0), _rec(32, 17.0), _rec(8, 0.7, "bf16")))
    assert db.compute_record("s", "gpu", "fp32", 8).fwd_ms == 5.0
    assert db.compute_record("s", "gpu", "fp32", 2).fwd_ms == 1.0   # 2/1 < 8/2
    assert db.compute_record("s", "gpu", "fp32", 16).fwd_ms == 17.0  # 16/8 = 32/16: the larger
    assert db.compute_record("s", "gpu", "fp32", 100).fwd_ms == 17.0
    assert db.compute_record("s", "gpu", "bf16", 1).fwd_ms == 0.7   # only one bf16 record
    assert db.compute_record("s", "gpu", "fp16", 8) is None         # never another dtype
    assert db.compute_record("s", "cpu", "fp32", 8) is None


def test_records_at_several_batches_are_distinct_keys() -> None:
    db = merge(ProfileDB(compute=(_rec(1, 1.0),)), ProfileDB(compute=(_rec(8, 5.0),)))
    assert [r.batch_size for r in db.compute] == [1, 8]


def test_missing_or_non_integer_version(tmp_path: Path) -> None:
    with pytest.raises(SpecError, match="missing 'schema_version'"):
        ProfileDB.load(_write(tmp_path, {"compute": []}))
    with pytest.raises(SpecError, match="must be an integer"):
        ProfileDB.load(_write(tmp_path, {"schema_version": "1"}))


def test_bad_json_names_line_and_column(tmp_path: Path) -> None:
    path = _write(tmp_path, '{"schema_version": 1,\n "compute": [}\n')
    with pytest.raises(SpecError) as e:
        ProfileDB.load(path)
    assert "not valid JSON" in str(e.value) and "line 2" in str(e.value)
    with pytest.raises(SpecError, match="not valid JSON"):
        ProfileDB.from_json("{", where="mem")
    with pytest.raises(SpecError, match="JSON object"):
        ProfileDB.from_json("[1, 2]")


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(SpecError, match="does not exist"):
        ProfileDB.load(tmp_path / "nope.json")


def test_unknown_key_names_field_path_and_suggests(tmp_path: Path) -> None:
    data = json.loads(_db().to_json())
    data["compute"][1]["fwd_msec"] = data["compute"][1].pop("fwd_ms")
    with pytest.raises(SpecError) as e:
        ProfileDB.load(_write(tmp_path, data))
    msg = str(e.value)
    assert "compute[1]" in msg and "fwd_msec" in msg and "did you mean 'fwd_ms'" in msg
    assert "hetplan profile" in msg


def test_out_of_range_value_names_field(tmp_path: Path) -> None:
    data = json.loads(_db().to_json())
    data["collectives"][0]["samples"][1]["seconds"] = -1.0
    with pytest.raises(SpecError, match=r"collectives\[0\]\.samples\[1\]\.seconds"):
        ProfileDB.load(_write(tmp_path, data))


@pytest.mark.parametrize("section, field, value, kind", [
    ("compute", "fwd_ms", True, "a boolean"),
    ("compute", "fwd_ms", "1.5", "a string"),
    ("compute", "samples", True, "a boolean"),
    ("compute", "batch_size", "8", "a string"),
    ("collectives", "group_size", "8", "a string"),
])
def test_numbers_are_strict(tmp_path: Path, section: str, field: str, value: object,
                            kind: str) -> None:
    # before, pydantic's lax mode read fwd_ms: true as 1 ms and batch_size: "8" as 8
    data = json.loads(_db().to_json())
    data[section][0][field] = value
    with pytest.raises(SpecError, match=rf"{section}\[0\]\.{field}: expected (an integer|a "
                                        rf"number), got {kind}"):
        ProfileDB.load(_write(tmp_path, data))


def test_duplicate_key_in_one_db(tmp_path: Path) -> None:
    data = json.loads(_db().to_json())
    data["compute"].append(dict(data["compute"][0]))
    with pytest.raises(SpecError, match="appears 2 times"):
        ProfileDB.load(_write(tmp_path, data))


def test_collective_record_needs_samples_or_fit() -> None:
    with pytest.raises(ValueError, match="neither samples nor"):
        CollectiveRecord(collective="allreduce", backend="nccl", link_kind="nvlink",
                         group_size=2)
    with pytest.raises(ValueError, match="both"):
        CollectiveRecord(collective="allreduce", backend="nccl", link_kind="nvlink",
                         group_size=2, alpha_s=1e-5)
    ok = CollectiveRecord(collective="allreduce", backend="nccl", link_kind="nvlink",
                          group_size=2, alpha_s=1e-5, beta_s_per_byte=1e-10)
    assert ok.num_samples == 0


def test_unknown_collective_name(tmp_path: Path) -> None:
    data = json.loads(_db().to_json())
    data["collectives"][0]["collective"] = "all_reduce"
    with pytest.raises(SpecError, match="did you mean 'allreduce'"):
        ProfileDB.load(_write(tmp_path, data))
