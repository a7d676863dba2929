"""The control token's files (runtime/auth.py): private, found by address, never trusted when
someone else could have written or read them."""

from __future__ import annotations

import os
import stat

import pytest

from taipan import auth


@pytest.fixture
def runtime_dir(tmp_path, monkeypatch):
    monkeypatch.setenv(auth.ENV_DIR, str(tmp_path / "rt"))
    monkeypatch.delenv(auth.ENV_TOKEN, raising=False)
    return tmp_path / "rt"


def test_a_published_token_is_private_and_found_by_any_spelling_of_the_address(runtime_dir):
    token = auth.new_token()
    path = auth.publish_token("tcp://localhost:5555", token)
    assert path.parent == runtime_dir
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE(runtime_dir.stat().st_mode) == 0o700
    assert auth.find_token("tcp://127.0.0.1:5555") == token  # localhost is 127.0.0.1
    assert auth.find_token("tcp://127.0.0.1:5556") is None
    assert len(token) >= 40 and auth.new_token() != token


def test_ipc_addresses_are_made_absolute(runtime_dir, monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    auth.publish_token("ipc://sock/front", "t0k")
    assert auth.find_token(f"ipc://{tmp_path}/sock/front") == "t0k"


def test_the_environment_wins_and_a_file_others_can_read_is_ignored(runtime_dir, monkeypatch):
    path = auth.publish_token("tcp://127.0.0.1:7000", "from-file")
    monkeypatch.setenv(auth.ENV_TOKEN, "from-env")
    assert auth.find_token("tcp://127.0.0.1:7000") == "from-env"
    monkeypatch.delenv(auth.ENV_TOKEN)
    os.chmod(path, 0o644)  # group/other readable: someone else may have planted or read it
    assert auth.find_token("tcp://127.0.0.1:7000") is None
    os.chmod(path, 0o600)
    path.write_text("not json")
    assert auth.find_token("tcp://127.0.0.1:7000") is None  # unusable, not an exception


def test_remove_token_leaves_another_runtimes_token_alone(runtime_dir):
    first = auth.publish_token("tcp://127.0.0.1:7001", "first")
    auth.publish_token("tcp://127.0.0.1:7001", "second")  # a later runtime at that address
    auth.remove_token(first, "first")
    assert auth.find_token("tcp://127.0.0.1:7001") == "second"
    auth.remove_token(first, "second")
    assert not first.exists()
