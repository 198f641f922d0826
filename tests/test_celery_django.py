"""fenced's settings from Django settings: ``app.config_from_object("django.conf:settings",
namespace="CELERY")`` reads every ``CELERY_FENCED_*`` setting as its ``fenced_*`` one.

Each case runs in a process of its own (Django's settings are configured once per
process), with a real Django settings module and a real Redis for the claims.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import redis

from fenced._lease import ClaimKeys
from fenced.celery import DEFAULTS
from fenced.celery._options import SETTINGS
from fenced.testing import RedisServer

ROOT = Path(__file__).resolve().parent.parent

SETTINGS_MODULE = """
SECRET_KEY = "fenced-tests"
INSTALLED_APPS = []
CELERY_BROKER_URL = "memory://"
CELERY_TASK_ALWAYS_EAGER = True

CELERY_FENCED_ENABLED = {enabled}
CELERY_FENCED_REDIS_URL = {url!r}
CELERY_FENCED_REDIS_OPTIONS = {{"socket_timeout": 7.5}}
CELERY_FENCED_REDIS_CLIENT = "djsettings:make_client"
CELERY_FENCED_CLAIM_TTL = 12
CELERY_FENCED_CLAIM_REFRESH_EVERY = 2
CELERY_FENCED_CLAIM_ON_BUSY = "raise"
CELERY_FENCED_CLAIM_ALERT_AFTER_SKIPS = 7
CELERY_FENCED_CLAIM_INTERRUPT = False
CELERY_FENCED_NAMESPACE = "djns"
CELERY_FENCED_CLAIM_UNAVAILABLE_BACKOFF = 0.25
CELERY_FENCED_CLAIM_UNAVAILABLE_RETRIES = 4
CELERY_FENCED_CLAIM_REDELIVERY_WINDOW = 120
CELERY_FENCED_CLAIM_IDLE_TTL = 3600
CELERY_FENCED_CLAIM_REPLICAS = 1
CELERY_FENCED_CLAIM_REPLICA_TIMEOUT = 0.5
CELERY_FENCED_CLAIM_ENQUEUE = "until_started"
CELERY_FENCED_CLAIM_ENQUEUE_TTL = 600
CELERY_FENCED_CLAIM_COOLDOWN = 30
CELERY_FENCED_CLAIM_LIMIT = 2
CELERY_FENCED_CLAIM_LABEL = "dj-label"
CELERY_FENCED_CLAIM_RATE = "5/m"
CELERY_FENCED_CLAIM_RATE_SPREAD = True
CELERY_FENCED_CLAIM_RATE_POLICY = "skip"
CELERY_FENCED_METRICS = {enabled}
CELERY_FENCED_METRICS_PORT = 9808 if {enabled} else None


def alert(sender, name, skips, holder):
    pass


CELERY_FENCED_CLAIM_ON_SKIPS_EXCEEDED = alert


def make_client():
    import redis

    client = redis.Redis.from_url(CELERY_FENCED_REDIS_URL)
    client.made_by = "djsettings"
    return client
"""

SCRIPT = """
import json
import os

os.environ["DJANGO_SETTINGS_MODULE"] = "djsettings"

import redis
from celery import Celery

from fenced.celery import ClaimedTask, LocalClaim
from fenced.celery._disabled import enabled
from fenced.celery._metrics import settings as metrics_settings
from fenced.celery._options import lock_redis, lock_url
from fenced.doctor import check_celery

app = Celery("dj", set_as_current=False)
app.config_from_object("django.conf:settings", namespace="CELERY")


@app.task(base=ClaimedTask, bind=True, shared=False, name="dj.plain", claim="p:{key}")
def plain(self, key):
    return key


@app.task(
    base=ClaimedTask, bind=True, shared=False, name="dj.run", claim="r:{key}", claim_replicas=0
)
def run(self, key):
    claim = self.claim
    return {
        "local": isinstance(claim, LocalClaim),
        "fence": claim.fence,
        "pttl": claim.redis.pttl(claim.key) if claim.redis is not None else None,
        "made_by": getattr(claim.redis, "made_by", None),
        "label": claim.label,
    }


options = plain._options()
out = {
    "options": {k: (v.__name__ if callable(v) else v) for k, v in options.values.items()},
    "enabled": enabled(app),
    "metrics": metrics_settings(app),
    "url": lock_url(app),
    "run": run.apply(args=("k1",)).get(),
    "findings": sorted(f.code for f in check_celery(app)),
}
app.conf.fenced_redis_client = None  # the URL and its options, without the factory
client = lock_redis(app)
out["socket_timeout"] = client.connection_pool.connection_kwargs.get("socket_timeout")
print(json.dumps(out))
"""


def run_django(tmp_path: Path, url: str, enabled: bool) -> dict[str, Any]:
    (tmp_path / "djsettings.py").write_text(SETTINGS_MODULE.format(url=url, enabled=enabled))
    (tmp_path / "script.py").write_text(textwrap.dedent(SCRIPT))
    env = {k: v for k, v in os.environ.items() if not k.startswith("FENCED_")}
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path), str(ROOT / "src")])
    res = subprocess.run(
        [sys.executable, str(tmp_path / "script.py")],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
        cwd=tmp_path,
    )
    assert res.returncode == 0, res.stderr
    out: dict[str, Any] = json.loads(res.stdout.strip().splitlines()[-1])
    return out


def test_every_fenced_setting_is_read_from_django_settings_with_the_celery_namespace(
    tmp_path: Path, redis_server: RedisServer
) -> None:
    pytest.importorskip("django")
    url = redis_server.url.rsplit("/", 1)[0] + "/5"
    out = run_django(tmp_path, url, enabled=True)
    # Every option's setting was given, with a value that is not its default.
    given = {
        "claim_ttl": 12,
        "claim_refresh_every": 2,
        "claim_on_busy": "raise",
        "claim_alert_after_skips": 7,
        "claim_on_skips_exceeded": "alert",
        "claim_interrupt": False,
        "claim_namespace": "djns",
        "claim_unavailable_backoff": 0.25,
        "claim_unavailable_retries": 4,
        "claim_redelivery_window": 120,
        "claim_idle_ttl": 3600,
        "claim_replicas": 1,
        "claim_replica_timeout": 0.5,
        "claim_enqueue": "until_started",
        "claim_enqueue_ttl": 600,
        "claim_cooldown": 30,
        "claim_limit": 2,
        "claim_label": "dj-label",
        "claim_rate": "5/m",
        "claim_rate_spread": True,
        "claim_rate_policy": "skip",
    }
    # claim_debounce (and its max) go with none of claim_enqueue, claim_cooldown,
    # claim_limit=2, claim_on_busy="raise": they are read by the same SETTINGS path.
    assert set(given) == set(SETTINGS) - {"claim_debounce", "claim_debounce_max"}
    assert all(DEFAULTS[option] != value for option, value in given.items())
    # The task resolved each to the value its setting gave.
    assert out["options"] == {**given, "claim_debounce": None, "claim_debounce_max": None}
    assert out["enabled"] is True and out["url"] == url
    # The worker's settings, beside the task options.
    assert out["metrics"] == [True, 9808]
    run = out["run"]
    # The run took a real claim through the factory's client, in the namespace, with
    # the ttl from settings.
    assert not run["local"] and run["made_by"] == "djsettings"
    assert run["label"] == "dj-label"
    assert 0 < run["pttl"] <= 12000
    fence = redis.Redis.from_url(url).get(ClaimKeys.of("r:k1", "djns").fence)
    assert fence is not None and int(fence) == run["fence"]
    assert out["socket_timeout"] == 7.5
    assert "fenced.lock-store-missing" not in out["findings"]
    assert "celery.fenced-disabled" not in out["findings"]


def test_claims_switched_off_from_django_settings(
    tmp_path: Path, redis_server: RedisServer
) -> None:
    pytest.importorskip("django")
    url = redis_server.url.rsplit("/", 1)[0] + "/6"
    out = run_django(tmp_path, url, enabled=False)
    assert out["enabled"] is False
    assert out["metrics"] == [False, None]
    assert out["run"]["local"] and out["run"]["pttl"] is None
    assert "celery.fenced-disabled" in out["findings"]
    assert redis.Redis.from_url(url).dbsize() == 0
