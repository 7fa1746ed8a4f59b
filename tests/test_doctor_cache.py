"""`omnidraft doctor` says what the cache holds on disk, and `--clear-cache` removes only what is
built again at next use: a user's profiles and the measurements stay."""

from __future__ import annotations

from omnidraft.cli.commands import main


def test_doctor_lists_the_cache_by_part_and_clear_cache_keeps_profiles_and_measurements(
    tmp_path, monkeypatch, capsys
):
    monkeypatch.setenv("OMNIDRAFT_CACHE", str(tmp_path))
    (tmp_path / "converted" / "smollm2-135m-1").mkdir(parents=True)
    (tmp_path / "converted" / "smollm2-135m-1" / "model.safetensors").write_bytes(b"x" * 3 * 2**20)
    (tmp_path / "gguf").mkdir()
    (tmp_path / "gguf" / "qwen.gguf").write_bytes(b"x" * 2**20)
    (tmp_path / "profiles" / "alice").mkdir(parents=True)
    (tmp_path / "profiles" / "alice" / "adapter.pt").write_bytes(b"mine")
    (tmp_path / "measured").mkdir()
    (tmp_path / "measured" / "attention-k.json").write_text("{}")
    from omnidraft.cli.doctor import disk

    lines = disk()
    assert lines[0].startswith(f"cache {tmp_path}: 4 MB")
    assert any(line.strip().startswith("converted/ 3 MB: fp32 copies") for line in lines), lines
    assert any(line.strip() == "smollm2-135m-1 3 MB" for line in lines), lines
    assert any(line.strip().startswith("profiles/ 0 MB: pairing profiles") for line in lines), lines
    assert main(["doctor", "--clear-cache"]) is None
    out = capsys.readouterr().out
    assert f"removed {tmp_path / 'converted'} (3 MB; rebuilt at next use)" in out
    assert f"removed {tmp_path / 'gguf'} (1 MB; rebuilt at next use)" in out
    assert not (tmp_path / "converted").exists() and not (tmp_path / "gguf").exists()
    assert (tmp_path / "profiles" / "alice" / "adapter.pt").read_bytes() == b"mine"
    assert (tmp_path / "measured" / "attention-k.json").exists()
    main(["doctor", "--clear-cache"])
    assert capsys.readouterr().out.strip() == f"nothing to clear under {tmp_path}"
