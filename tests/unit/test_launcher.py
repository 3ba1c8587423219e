"""The launcher's quiet paths: a stop after Ctrl-C or SIGTERM that finds the
local Ray already gone warns nothing (it is the normal way down), and a
local Ray starts with token authentication chosen, so Ray does not warn."""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from typing import Any

import pytest
from ray._private.authentication import authentication_token_setup as ray_auth
from ray._raylet import AuthenticationMode, Config, get_authentication_mode

from cluster.launch import launcher

GONE = "the local Ray is gone"


def _cluster_whose_ray_is_gone(monkeypatch: pytest.MonkeyPatch) -> launcher.RunningCluster:
    monkeypatch.setattr(launcher, "_local_ray_alive", lambda: False)
    plan: Any = None  # shutdown never reads the plan
    return launcher.RunningCluster(plan)


async def test_a_stop_after_a_signal_that_finds_ray_gone_warns_nothing(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    cluster = _cluster_whose_ray_is_gone(monkeypatch)
    with caplog.at_level(logging.INFO, logger=launcher.__name__):
        await cluster.shutdown(after_signal=True)
    assert [r.levelno for r in caplog.records if GONE in r.message] == [logging.INFO]


async def test_ray_gone_without_a_signal_is_still_a_warning(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    cluster = _cluster_whose_ray_is_gone(monkeypatch)
    with caplog.at_level(logging.INFO, logger=launcher.__name__):
        await cluster.shutdown()
    assert [r.levelno for r in caplog.records if GONE in r.message] == [logging.WARNING]


@pytest.fixture
def auth_mode_restored() -> Iterator[None]:
    """This process's RAY_AUTH_MODE and Ray's cached config as they were."""
    before = os.environ.get(launcher._AUTH_MODE_ENV)
    yield
    if before is None:
        os.environ.pop(launcher._AUTH_MODE_ENV, None)
    else:
        os.environ[launcher._AUTH_MODE_ENV] = before
    Config.initialize("")


def test_a_local_ray_gets_token_auth_without_ray_s_warning(
    auth_mode_restored: None, caplog: pytest.LogCaptureFixture
) -> None:
    os.environ.pop(launcher._AUTH_MODE_ENV, None)
    launcher._choose_token_auth()
    assert get_authentication_mode() == AuthenticationMode.TOKEN
    # What ray.init runs for a new local cluster: it keeps the mode and says nothing.
    with caplog.at_level(logging.WARNING):
        assert ray_auth.enable_token_auth_by_default()
    assert not [r for r in caplog.records if "Token authentication" in r.message]


def test_a_user_s_own_auth_mode_is_kept(auth_mode_restored: None) -> None:
    os.environ[launcher._AUTH_MODE_ENV] = "disabled"
    launcher._choose_token_auth()
    assert os.environ[launcher._AUTH_MODE_ENV] == "disabled"
