"""Django settings for llmgw, read from LLMGW_* environment variables.

Every default works on one machine (SQLite and in-process layers in the data directory);
production sets LLMGW_DATABASE_URL (PostgreSQL) and LLMGW_REDIS_URL.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from django.core.exceptions import ImproperlyConfigured
from django.utils.csp import CSP
from django.utils.translation import gettext_lazy as _

from apps.accounts.sso_mapping import load_role_map
from apps.gateway.cors import parse_origins
from llmgw.env import (
    env_bool,
    env_float,
    env_int,
    env_list,
    env_listen,
    env_secret,
    env_str,
    parse_database_url,
    secret_key,
)

BASE_DIR = Path(__file__).resolve().parent.parent

# Data directory -----------------------------------------------------------------------

DATA_DIR = Path(env_str("LLMGW_DATA_DIR") or "var").expanduser().resolve()
try:
    DATA_DIR.mkdir(parents=True, exist_ok=True)
except OSError as exc:
    raise ImproperlyConfigured(
        f"LLMGW_DATA_DIR={str(DATA_DIR)!r}: cannot create the directory ({exc.strerror})"
    ) from None

SECRET_KEY = secret_key(DATA_DIR)
DEBUG = env_bool("LLMGW_DEBUG", False)
LISTEN = env_listen("LLMGW_LISTEN", "127.0.0.1:8000")
ALLOWED_HOSTS = env_list("LLMGW_ALLOWED_HOSTS", ["127.0.0.1", "localhost", "[::1]", "testserver"])
CSRF_TRUSTED_ORIGINS = env_list("LLMGW_CSRF_TRUSTED_ORIGINS", [])
# Operator-edited declarations (models: ...), applied when a worker starts.
SERVER_CONFIG = env_str("LLMGW_SERVER_CONFIG") or str(DATA_DIR / "server.yaml")
# Where people reach this service (shown in connection instructions); else the request's host.
PUBLIC_URL = env_str("LLMGW_PUBLIC_URL") or ""
# The manual at /docs is open to everyone unless this is on; its links to files outside docs/
# go to this repository.
DOCS_REQUIRE_SIGNIN = env_bool("LLMGW_DOCS_REQUIRE_SIGNIN", False)
REPOSITORY_URL = (env_str("LLMGW_REPOSITORY_URL") or "https://github.com/llmgw/llmgw/blob/main").rstrip("/")

# Applications -------------------------------------------------------------------------

INSTALLED_APPS = [
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "rest_framework",
    "drf_spectacular",
    "drf_spectacular_sidecar",
    "django_htmx",
    "channels",
    "tailwind",
    "llmgw.theme",
    "llmgw.console",
    "apps.accounts",
    "apps.quotas",
    "apps.catalog",
    "apps.cluster",
    "apps.fabrics",
    "apps.facility",
    "apps.guardrails",
    "apps.gateway",
    "apps.mirror",
    "apps.schedule",
    "apps.sim",
    "apps.batches",
]

MIDDLEWARE = [
    # Under ASGI, streamed answers (files, static files) are read chunk by chunk (llmgw.streaming).
    "llmgw.streaming.AsyncStreams",
    "django.middleware.security.SecurityMiddleware",
    "django.middleware.csp.ContentSecurityPolicyMiddleware",
    "whitenoise.middleware.WhiteNoiseMiddleware",
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.locale.LocaleMiddleware",
    # Under /api/ every error answer is JSON; a NUL in a path, query, form or cookie is a 400 (llmgw.edge).
    "llmgw.edge.JsonApiErrors",
    "llmgw.edge.RefuseNul",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
    "django.middleware.clickjacking.XFrameOptionsMiddleware",
    "django_htmx.middleware.HtmxMiddleware",
]

ROOT_URLCONF = "llmgw.urls"
ASGI_APPLICATION = "llmgw.asgi.application"
WSGI_APPLICATION = None

TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "DIRS": [BASE_DIR / "templates"],
        "APP_DIRS": True,
        "OPTIONS": {
            "context_processors": [
                "django.template.context_processors.request",
                "django.template.context_processors.i18n",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
                "django.template.context_processors.csp",
                "llmgw.console.context_processors.console",
                "apps.accounts.oidc.sign_in_options",
            ],
        },
    }
]

# Database -----------------------------------------------------------------------------

DATABASE_URL = env_str("LLMGW_DATABASE_URL") or f"sqlite:///{DATA_DIR / 'llmgw.sqlite3'}"
DATABASE = parse_database_url("LLMGW_DATABASE_URL", DATABASE_URL)
# Which process this is: `llmgw web`, `llmgw worker` and `llmgw beat` say so before the settings load
# (llmgw.cli); anything else (manage, the tests, an ASGI server started by hand) counts as web.
PROCESS = (env_str("LLMGW_PROCESS") or "web").lower()
if PROCESS not in {"web", "worker", "beat"}:
    raise ImproperlyConfigured(f"LLMGW_PROCESS={PROCESS!r}: expected web, worker or beat")
# PostgreSQL connections a web process holds at most, and how long a request waits for one when all
# are busy. The worker and beat keep no pool: Celery closes a prefork process's pool after every
# task, under the feet of the batch runner's thread (apps.batches.host). Their threads open a
# connection each while they query instead; a worker process's batch runner runs its queries on at
# most this many threads. A deployment needs, at most: web processes x this + worker processes x
# their concurrency x (this + 2) + 1 per worker + 1 per beat (docs/install.md).
DATABASE_POOL_SIZE = env_int("LLMGW_DATABASE_POOL_SIZE", 10, minimum=1, maximum=1000)
DATABASE_POOL_TIMEOUT = env_float("LLMGW_DATABASE_POOL_TIMEOUT", 30.0, minimum=1.0, maximum=600.0)
DATABASES = {
    "default": DATABASE.django(
        pool_size=DATABASE_POOL_SIZE if PROCESS == "web" else None, pool_timeout=DATABASE_POOL_TIMEOUT
    )
}
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

# Agents ------------------------------------------------------------------------------

# How often the GPU and core time that replicas hold is counted for their owners (the usage page's
# GPU-hours are this late at most).
HELD_TIME_SECONDS = env_int("LLMGW_HELD_TIME_SECONDS", 60, minimum=1, maximum=3600)
AGENT_HEARTBEAT_INTERVAL = env_int("LLMGW_AGENT_HEARTBEAT_SECONDS", 10, minimum=1, maximum=300)
# A node is unreachable after this many heartbeats in a row went missing.
# How many agents one web process takes through their first moments at once (credential check,
# registration, first shard list), and how many more may wait for that with their connection
# open; past those, an agent is told to come back after its backoff (apps.cluster.consumers).
AGENT_JOINING_AT_ONCE = env_int("LLMGW_AGENT_JOINING_AT_ONCE", 64, minimum=1, maximum=1_000)
AGENT_JOINS_WAITING = env_int("LLMGW_AGENT_JOINS_WAITING", 10_000, minimum=0, maximum=100_000)
AGENT_MISSED_HEARTBEATS = env_int("LLMGW_AGENT_MISSED_HEARTBEATS", 3, minimum=1, maximum=100)
AGENT_ENROLLMENT_TTL = env_int("LLMGW_AGENT_ENROLLMENT_SECONDS", 3600, minimum=60)

# Redis, Celery, Channels --------------------------------------------------------------

REDIS_URL = env_str("LLMGW_REDIS_URL") or ""
REDIS_PREFIX = env_str("LLMGW_REDIS_PREFIX") or "llmgw"
if REDIS_URL and not REDIS_URL.startswith(("redis://", "rediss://", "unix://")):
    raise ImproperlyConfigured(f"LLMGW_REDIS_URL={REDIS_URL!r}: expected a URL starting with redis:// or rediss://")

CELERY_QUEUE_DIR = DATA_DIR / "queue"
if REDIS_URL:
    CELERY_BROKER_URL = REDIS_URL
    # Idle pooled connections are checked before use, so those to a Redis that restarted are made anew.
    CELERY_BROKER_TRANSPORT_OPTIONS: dict[str, object] = {
        "health_check_interval": 15,
        "socket_timeout": 30,
        "socket_connect_timeout": 5,
        "retry_on_timeout": True,
    }
    CHANNEL_LAYERS = {
        "default": {
            # channels_redis's layer, sized for the agents a process holds, waiting for a free
            # connection instead of failing, and counting what it drops (llmgw/channel_layer.py).
            "BACKEND": "llmgw.channel_layer.ChannelLayer",
            # redis-py 8 reads with a 5 s socket timeout by default, the same as the layer's
            # blocking pop: a quiet connection would then time out and kill its consumer.
            "CONFIG": {
                "hosts": [{"address": REDIS_URL, "socket_timeout": 30, "socket_connect_timeout": 5}],
                "prefix": REDIS_PREFIX,
                "capacity": env_int("LLMGW_CHANNEL_CAPACITY", 20_000, minimum=100),
                "group_expiry": env_int("LLMGW_CHANNEL_GROUP_EXPIRY", 900, minimum=120),
                "pool": {"max_connections": env_int("LLMGW_CHANNEL_POOL_SIZE", 64, minimum=4)},
            },
        }
    }
    CACHES: dict[str, dict[str, Any]] = {
        "default": {"BACKEND": "django.core.cache.backends.redis.RedisCache", "LOCATION": REDIS_URL}
    }
else:
    CELERY_BROKER_URL = "filesystem://"
    CELERY_BROKER_TRANSPORT_OPTIONS = {
        "data_folder_in": str(CELERY_QUEUE_DIR / "messages"),
        "data_folder_out": str(CELERY_QUEUE_DIR / "messages"),
        "control_folder": str(CELERY_QUEUE_DIR / "control"),
        "store_processed": False,
    }
    CHANNEL_LAYERS = {"default": {"BACKEND": "channels.layers.InMemoryChannelLayer"}}
    # One key per node's history, per node's rollup state and per model's engine figures: the
    # default cap of 300 keys would drop the figures of all but the smallest fleets.
    CACHES = {
        "default": {"BACKEND": "django.core.cache.backends.locmem.LocMemCache", "OPTIONS": {"MAX_ENTRIES": 200_000}}
    }

CELERY_TASK_IGNORE_RESULT = True
CELERY_TASK_ACKS_LATE = True
CELERY_WORKER_PREFETCH_MULTIPLIER = 1
CELERY_BROKER_CONNECTION_RETRY_ON_STARTUP = True
# A broker that goes away is waited for, however long (`llmgw worker` also restarts a worker that
# gave up), and a task running when the connection was lost is cancelled, not run twice.
CELERY_BROKER_CONNECTION_RETRY = True
CELERY_BROKER_CONNECTION_MAX_RETRIES = None
CELERY_WORKER_CANCEL_LONG_RUNNING_TASKS_ON_CONNECTION_LOSS = True
CELERY_WORKER_HIJACK_ROOT_LOGGER = False
# How often each InfiniBand fabric is mapped (ibnetdiscover through one of its nodes), in seconds.
FABRIC_MAP_INTERVAL = env_float("LLMGW_FABRIC_MAP_INTERVAL", 300.0, minimum=5, maximum=86400)
CELERY_BEAT_SCHEDULE_FILENAME = str(DATA_DIR / "celerybeat-schedule")
# Several beats may run; one acts at a time, holding a lease in the database that it renews four
# times per lease and that another takes once it expires (apps/schedule/lease.py).
CELERY_BEAT_SCHEDULER = "apps.schedule.scheduler:LeasedScheduler"
BEAT_LEASE_SECONDS = env_float("LLMGW_BEAT_LEASE_SECONDS", 10.0, minimum=1.0, maximum=600.0)
# The one beat schedule: task names as strings, intervals in seconds.
CELERY_BEAT_SCHEDULE: dict[str, dict[str, object]] = {
    "mark-unreachable-nodes": {
        "task": "apps.cluster.tasks.mark_unreachable_nodes",
        "schedule": float(min(5, AGENT_HEARTBEAT_INTERVAL)),
    },
    "reconcile": {"task": "apps.cluster.tasks.reconcile", "schedule": 5.0},
    # Messages are notifications, never the only copy: resend every node its shard list.
    "push-desired-state": {"task": "apps.cluster.tasks.push_desired_state", "schedule": 60.0},
    # Engine releases the nodes want and the control plane has not read yet (or failed to read).
    "fetch-engine-releases": {"task": "apps.cluster.tasks.fetch_engine_releases", "schedule": 60.0},
    "start-mirror-fetches": {"task": "apps.mirror.tasks.start_mirror_fetches", "schedule": 60.0},
    # Usage journals of web processes on the worker's host that died and were not started again.
    "settle-usage-journals": {"task": "apps.quotas.tasks.settle_usage_journals", "schedule": 60.0},
    "expire-agent-requests": {"task": "apps.cluster.tasks.expire_agent_requests", "schedule": 15.0},
    # One node per InfiniBand fabric maps it with ibnetdiscover.
    "map-fabrics": {"task": "apps.fabrics.tasks.map_fabrics", "schedule": FABRIC_MAP_INTERVAL},
    # GPU and core time held per owner (a released shard's last stretch is counted as it goes).
    "accrue-held-time": {"task": "apps.cluster.tasks.accrue_held_time", "schedule": float(HELD_TIME_SECONDS)},
    # The cluster page's held idle cards, worked out once for every look at the page (its figure
    # is apps.cluster.overview.IDLE_SUMMARY_SECONDS).
    "summarise-idle-cards": {"task": "apps.cluster.tasks.summarise_idle_cards", "schedule": 15.0},
    # Simulations: start what waits, fail a run whose worker stopped, remove old runs.
    "sweep-sim-runs": {"task": "apps.sim.tasks.sweep_sim_runs", "schedule": 60.0},
    # Stored Responses API answers past LLMGW_RESPONSES_RETENTION_DAYS.
    "delete-expired-responses": {"task": "apps.gateway.tasks.delete_expired_responses", "schedule": 3600.0},
    # Batches: expire those past their 24 h window, remove files past their expiry.
    "sweep-batches": {"task": "apps.batches.tasks.sweep_batches", "schedule": 60.0},
}

# Where the gateway's usage batches are written: "worker" (a Celery task, so web processes
# spend no time in the ORM; written in process if the broker refuses) or "web".
USAGE_WRITER = env_str("LLMGW_USAGE_WRITER") or "worker"
if USAGE_WRITER not in {"worker", "web"}:
    raise ImproperlyConfigured(f"LLMGW_USAGE_WRITER={USAGE_WRITER!r}: expected worker or web")

# Request bodies outside /v1 ----------------------------------------------------------

# The console, /api/v1 and the admin take forms and JSON documents (a model's spec, a limit, a
# key) of a few kilobytes, and no file uploads: 16 MiB leaves room for any of them many times
# over and keeps one anonymous POST from filling the disk. llmgw/bodylimit.py refuses a larger
# body with a 413 before Django reads a byte of it. /v1 has its own bound (GATEWAY_MAX_BODY_BYTES).
MAX_REQUEST_BODY_BYTES = env_int("LLMGW_MAX_REQUEST_BODY_BYTES", 16 * 1024 * 1024, minimum=64 * 1024)
# Django's own checks agree with it: form and JSON data are taken up to the same bound, kept in
# memory up to Django's usual 2.5 MiB and spooled to a temporary file (never larger than the bound) past it.
DATA_UPLOAD_MAX_MEMORY_SIZE = MAX_REQUEST_BODY_BYTES
FILE_UPLOAD_MAX_MEMORY_SIZE = min(MAX_REQUEST_BODY_BYTES, 2_621_440)

# The gateway -------------------------------------------------------------------------

# Requests waiting for a replica slot, per model (across every gateway process with Redis), and for how long.
GATEWAY_QUEUE_MAX = env_int("LLMGW_GATEWAY_QUEUE_MAX", 256, minimum=0, maximum=1_000_000)
GATEWAY_QUEUE_TIMEOUT = env_float("LLMGW_GATEWAY_QUEUE_TIMEOUT", 30.0, minimum=0, maximum=3600)
# How long a request of the batch band waits for a slot, and of every how many slot grants of a
# model one goes to a waiting batch request (apps.gateway.fairness).
GATEWAY_BATCH_QUEUE_TIMEOUT = env_float("LLMGW_GATEWAY_BATCH_QUEUE_TIMEOUT", 600.0, minimum=0, maximum=86400)
GATEWAY_BATCH_EVERY = env_int("LLMGW_GATEWAY_BATCH_EVERY", 10, minimum=2, maximum=10_000)
# How long a request for a model kept at zero replicas waits for its first replica to start.
GATEWAY_COLD_START_TIMEOUT = env_float("LLMGW_GATEWAY_COLD_START_TIMEOUT", 120.0, minimum=0, maximum=3600)
GATEWAY_MAX_BODY_BYTES = env_int("LLMGW_GATEWAY_MAX_BODY_BYTES", 32 * 1024 * 1024, minimum=1024)
# The request bodies one gateway process holds at once, all requests together.
GATEWAY_BODY_MEMORY_BYTES = env_int("LLMGW_GATEWAY_BODY_MEMORY_BYTES", 256 * 1024 * 1024, minimum=1024 * 1024)
# The most messages, and content parts over all messages, one request may give an engine.
GATEWAY_MAX_MESSAGES = env_int("LLMGW_GATEWAY_MAX_MESSAGES", 4096, minimum=1)
GATEWAY_MAX_PARTS = env_int("LLMGW_GATEWAY_MAX_PARTS", 8192, minimum=1)
# Origins whose pages may call /v1 from a browser (CORS): scheme://host[:port], comma-separated, or *
# (allowed there: every /v1 route takes an API key in a header, never a cookie). None by default.
try:
    GATEWAY_CORS_ORIGINS = parse_origins(env_list("LLMGW_CORS_ORIGINS", []))
except ValueError as exc:
    raise ImproperlyConfigured(str(exc)) from None
# Responses API answers are stored (the API's `store`, true unless a request says false) for this
# many days, to be fetched, deleted and continued with previous_response_id; off stores none.
RESPONSES_STORE = env_bool("LLMGW_RESPONSES_STORE", True)
RESPONSES_RETENTION_DAYS = env_int("LLMGW_RESPONSES_RETENTION_DAYS", 30, minimum=1, maximum=3650)
# How long the gateway waits for the next bytes of an engine's answer (a stream's next chunk too).
GATEWAY_READ_TIMEOUT = env_float("LLMGW_GATEWAY_READ_TIMEOUT", 600.0, minimum=1, maximum=86400)
# How often the table version is read, and how often the tables are read whole whatever it says.
GATEWAY_REFRESH_SECONDS = env_float("LLMGW_GATEWAY_REFRESH_SECONDS", 1.0, minimum=0.01, maximum=300)
GATEWAY_RELOAD_SECONDS = env_float("LLMGW_GATEWAY_RELOAD_SECONDS", 30.0, minimum=0.05, maximum=3600)
# With Redis: how long a replica slot held by a gateway process that died stays counted.
GATEWAY_SLOT_LEASE_SECONDS = env_float("LLMGW_GATEWAY_SLOT_LEASE_SECONDS", 15.0, minimum=1, maximum=600)
# External providers are reached through HTTPS_PROXY/HTTP_PROXY (NO_PROXY exempts), never engines;
# their certificates are checked against this PEM file or hashed directory instead of the system's.
PROVIDER_CA_BUNDLE = env_str("LLMGW_PROVIDER_CA_BUNDLE") or ""
if PROVIDER_CA_BUNDLE and not Path(PROVIDER_CA_BUNDLE).exists():
    raise ImproperlyConfigured(f"LLMGW_PROVIDER_CA_BUNDLE={PROVIDER_CA_BUNDLE!r}: no such file or directory")

# Batches (apps.batches) ---------------------------------------------------------------

# Where uploaded files and batches' output files are kept (shared storage when web runs on several hosts).
BATCH_STORAGE_DIR = Path(env_str("LLMGW_BATCH_STORAGE_DIR") or str(DATA_DIR / "batches")).expanduser()
# One file, and one batch input file's lines (OpenAI's 200 MB and 50,000 requests; Anthropic's
# Message Batches take up to 100,000 requests in one body of at most BATCH_MAX_FILE_BYTES).
BATCH_MAX_FILE_BYTES = env_int("LLMGW_BATCH_MAX_FILE_BYTES", 200 * 1000 * 1000, minimum=1024)
BATCH_MAX_LINES = env_int("LLMGW_BATCH_MAX_LINES", 50_000, minimum=1, maximum=1_000_000)
MESSAGE_BATCH_MAX_REQUESTS = env_int("LLMGW_MESSAGE_BATCH_MAX_REQUESTS", 100_000, minimum=1, maximum=1_000_000)
# What one organisation's files may hold on disk together (its batches' output files included).
BATCH_ORG_STORAGE_BYTES = env_int("LLMGW_BATCH_ORG_STORAGE_BYTES", 100 * 1000**3, minimum=1024)
# Batch lines count against token limits and budgets at this many tokens per token used.
BATCH_PRICE_FACTOR = env_float("LLMGW_BATCH_PRICE_FACTOR", 0.5, minimum=0.0, maximum=10.0)
# How many times a line whose try failed on the way (a replica that died, a 5xx) is tried in all.
BATCH_LINE_ATTEMPTS = env_int("LLMGW_BATCH_LINE_ATTEMPTS", 3, minimum=1, maximum=20)
# How long a web process holds the lines it took; a process that died lets them go after this.
BATCH_LEASE_SECONDS = env_float("LLMGW_BATCH_LEASE_SECONDS", 30.0, minimum=2.0, maximum=3600.0)
# Days an uploaded batch file and a batch's output files are kept (OpenAI keeps them 30 days).
BATCH_FILE_DAYS = env_int("LLMGW_BATCH_FILE_DAYS", 30, minimum=1, maximum=3650)
# Which processes run batch lines (apps.batches.host): "worker", the Celery worker's processes,
# each beside its tasks; "web", each web process through its own gateway; "off", neither (web
# processes still take files and batches). "auto" (the default): the workers where Redis is
# configured, the web process without it. The worker's lines must give way to the web processes'
# requests, which they can see only through the slots and queues Redis shares: without Redis the
# web process, then the only gateway, is the one place that can run them. 1/0 read as auto/off.
_batch_runner = (env_str("LLMGW_BATCH_RUNNER") or "auto").lower()
_batch_runner = {"1": "auto", "true": "auto", "yes": "auto", "on": "auto", "0": "off", "false": "off", "no": "off"}.get(
    _batch_runner, _batch_runner
)
if _batch_runner not in {"auto", "worker", "web", "off"}:
    raise ImproperlyConfigured(f"LLMGW_BATCH_RUNNER={_batch_runner!r}: expected auto, worker, web or off")
if _batch_runner == "worker" and not REDIS_URL:
    raise ImproperlyConfigured(
        "LLMGW_BATCH_RUNNER=worker needs LLMGW_REDIS_URL: without Redis each process counts replica slots on "
        "its own, so a worker's lines could neither see nor give way to the web process's requests; "
        "use auto or web"
    )
if _batch_runner == "auto":
    _batch_runner = "worker" if REDIS_URL else "web"
BATCH_RUNNER = _batch_runner
# The largest answer one line may get; a larger one fails the line, saying so.
BATCH_MAX_RESPONSE_BYTES = env_int("LLMGW_BATCH_MAX_RESPONSE_BYTES", 32 * 1024 * 1024, minimum=64 * 1024)

# Engines -----------------------------------------------------------------------------

ENGINE_PORT_MIN = env_int("LLMGW_ENGINE_PORT_MIN", 20000, minimum=1024, maximum=65000)
ENGINE_PORT_MAX = env_int("LLMGW_ENGINE_PORT_MAX", 29999, minimum=1024, maximum=65535)
ENGINE_STOP_GRACE = env_int("LLMGW_ENGINE_STOP_GRACE_SECONDS", 10, minimum=1, maximum=600)
# A replica that stops (replaced by a profile change, moved off a drained node, scaled down, its
# model deleted, preempted) first stops taking requests, then keeps its engines this long for the
# requests in flight, stopping them as soon as it is idle; a node's drain may set its own.
# `llmgw web` waits as long for its requests in flight when it is stopped.
DRAIN_GRACE = env_int("LLMGW_DRAIN_GRACE_SECONDS", 120, minimum=0, maximum=3600)
# Where the control plane reads engine releases (GitHub's REST API: releases/tags/<tag>), with an
# optional token (unauthenticated calls are limited to 60 an hour); nodes never call it themselves.
# Reached through HTTPS_PROXY/NO_PROXY like external providers, with the same CA bundle.
ENGINE_RELEASES_API = (env_str("LLMGW_ENGINE_RELEASES_API") or "https://api.github.com").rstrip("/")
ENGINE_RELEASES_TOKEN = env_secret("LLMGW_ENGINE_RELEASES_TOKEN") or ""
# Engine archives the control plane holds and serves its nodes (uploaded, or fetched once).
ENGINE_FILES_DIR = Path(env_str("LLMGW_ENGINE_FILES_DIR") or str(DATA_DIR / "engine-files")).expanduser()
# A CPU node that refused an engine archive (its digest is not the one published, or a path in it
# leaves its directory) compiles llama.cpp from source in its place only when this is on; off, it
# runs nothing new and says why until a good archive is offered.
ENGINE_SOURCE_AFTER_REFUSAL = env_bool("LLMGW_ENGINE_SOURCE_AFTER_REFUSAL", False)
# The model mirror: where it keeps what it fetched, the Hub it fetches from (any Hub-compatible
# server), how many files download at once, and the space it leaves free on its disk.
MIRROR_DIR = Path(env_str("LLMGW_MIRROR_DIR") or str(DATA_DIR / "mirror")).expanduser()
HF_ENDPOINT = (env_str("LLMGW_HF_ENDPOINT") or "https://huggingface.co").rstrip("/")
HF_TOKEN = env_secret("LLMGW_HF_TOKEN") or ""
MIRROR_CONCURRENT_FETCHES = env_int("LLMGW_MIRROR_CONCURRENT_FETCHES", 2, minimum=1, maximum=32)
MIRROR_RESERVE_GB = env_float("LLMGW_MIRROR_RESERVE_GB", 5.0, minimum=0.0, maximum=100000.0)
# The most taken for a file the Hub lists with no size (a small file kept in git, not LFS): counted
# at this size against free space, and refused past it.
MIRROR_UNSIZED_MAX_MB = env_int("LLMGW_MIRROR_UNSIZED_MAX_MB", 64, minimum=1, maximum=1_000_000)
# Where nodes keep what they fetch from the mirror (the same path on every node, inside one of
# their model_dirs): a model served from the mirror names its file there as its source. By default
# <data dir>/models/mirror: /var/lib/llmgw/models/mirror with the packaged LLMGW_DATA_DIR, and inside
# the model directory of `llmgw up`'s own agent (<data dir>/models) on a single machine.
MIRROR_NODE_DIR = (env_str("LLMGW_MIRROR_NODE_DIR") or str(DATA_DIR / "models" / "mirror")).rstrip("/")
# vLLM and SGLang environments: the CUDA build the nodes' package index publishes (PyPI's vLLM is
# built for CUDA 12.9), where torch comes from for a release's other builds ({variant}: cu130),
# and the free space a node needs while it installs one.
PYTHON_ENGINE_INDEX_VARIANT = env_str("LLMGW_PYTHON_ENGINE_INDEX_VARIANT") or "cu129"
TORCH_INDEX_URL = env_str("LLMGW_TORCH_INDEX_URL") or "https://download.pytorch.org/whl/{variant}"
PYTHON_ENGINE_FREE_GB = env_float("LLMGW_PYTHON_ENGINE_FREE_GB", 25.0, minimum=0.0, maximum=10000.0)
# Scaling under load: a replica is added while the gateway keeps queueing requests (every
# replica busy within the last SCALE_UP_WINDOW seconds), one at a time, and one is removed
# after SCALE_DOWN_AFTER seconds without such a moment.
SCALE_UP_WINDOW = env_int("LLMGW_SCALE_UP_WINDOW_SECONDS", 30, minimum=5, maximum=3600)
SCALE_DOWN_AFTER = env_int("LLMGW_SCALE_DOWN_AFTER_SECONDS", 300, minimum=10, maximum=86400)


# Authentication -----------------------------------------------------------------------

AUTH_USER_MODEL = "accounts.User"
LOGIN_URL = "login"
LOGIN_REDIRECT_URL = "landing"
LOGOUT_REDIRECT_URL = "login"
AUTH_PASSWORD_VALIDATORS = [
    {"NAME": "django.contrib.auth.password_validation.MinimumLengthValidator", "OPTIONS": {"min_length": 10}},
    {"NAME": "django.contrib.auth.password_validation.CommonPasswordValidator"},
]
# The sign-up page (/signup/) is closed unless this is on; accounts.throttle bounds both forms.
SIGNUP_OPEN = env_bool("LLMGW_SIGNUP_OPEN", False)
SESSION_COOKIE_HTTPONLY = True
SESSION_COOKIE_SAMESITE = "Lax"
SESSION_COOKIE_SECURE = env_bool("LLMGW_SECURE_COOKIES", False)
CSRF_COOKIE_SECURE = SESSION_COOKIE_SECURE

# Internationalisation -----------------------------------------------------------------

LANGUAGE_CODE = env_str("LLMGW_LANGUAGE") or "en"
LANGUAGES = [("en", _("English")), ("tr", _("Turkish"))]
if LANGUAGE_CODE not in dict(LANGUAGES):
    raise ImproperlyConfigured(f"LLMGW_LANGUAGE={LANGUAGE_CODE!r}: expected one of en, tr")
LOCALE_PATHS = [BASE_DIR / "locale"]
LANGUAGE_COOKIE_NAME = "llmgw_language"
USE_I18N = True
USE_TZ = True
TIME_ZONE = env_str("LLMGW_TIME_ZONE") or "UTC"

# Static files -------------------------------------------------------------------------

STATIC_URL = "/static/"
# Where collectstatic puts the files web serves: the data directory's by default; a folder several
# data directories share (LLMGW_STATIC_ROOT) is collected once for all of them.
STATIC_ROOT = Path(env_str("LLMGW_STATIC_ROOT") or DATA_DIR / "static").expanduser().resolve()
STATIC_ROOT.mkdir(parents=True, exist_ok=True)
STORAGES = {
    "default": {"BACKEND": "django.core.files.storage.FileSystemStorage"},
    "staticfiles": {"BACKEND": "whitenoise.storage.CompressedManifestStaticFilesStorage"},
}
TAILWIND_APP_NAME = "llmgw.theme"

# REST API -----------------------------------------------------------------------------

REST_FRAMEWORK = {
    "DEFAULT_AUTHENTICATION_CLASSES": [
        "apps.accounts.authentication.ApiKeyAuthentication",
        "rest_framework.authentication.SessionAuthentication",
    ],
    "DEFAULT_PERMISSION_CLASSES": ["rest_framework.permissions.IsAuthenticated"],
    # JSON only (the API and `ctl` speak nothing else), read by a parser that refuses what the
    # database would refuse later: deep nesting, NaN, NUL characters and lone surrogates.
    "DEFAULT_PARSER_CLASSES": ["llmgw.api_input.JSONParser"],
    "DEFAULT_SCHEMA_CLASS": "llmgw.api.AutoSchema",
    "DEFAULT_PAGINATION_CLASS": "llmgw.api_input.Pagination",
    "PAGE_SIZE": 200,
    "EXCEPTION_HANDLER": "llmgw.api.exception_handler",
    "UNAUTHENTICATED_USER": "django.contrib.auth.models.AnonymousUser",
}
SPECTACULAR_SETTINGS = {
    "TITLE": "llmgw API",
    "DESCRIPTION": "Manage llmgw: keys, organisations, nodes, models and usage.",
    "VERSION": "1",
    "SERVE_INCLUDE_SCHEMA": False,
    "SWAGGER_UI_DIST": "SIDECAR",
    "SWAGGER_UI_FAVICON_HREF": "SIDECAR",
    "REDOC_DIST": "SIDECAR",
    # No validator badge: it is an image from validator.swagger.io, which the CSP blocks and
    # which would tell that site where the schema lives.
    "SWAGGER_UI_SETTINGS": {"deepLinking": True, "validatorUrl": None},
    "SCHEMA_PATH_PREFIX": "/api/v1",
    # One name for each choice set that several fields share (else a warning per schema build).
    "ENUM_NAME_OVERRIDES": {
        "EngineNameEnum": "apps.cluster.engines.ENGINE_NAMES",
        "EngineBuildEnum": "apps.cluster.models.Node.EngineBuild",
        "BatchStatusEnum": "apps.batches.choices.BatchStatus",
        "NodeStatusEnum": "apps.cluster.choices.NodeStatus",
        "BandEnum": "apps.accounts.choices.Band",
    },
}

# Metrics ------------------------------------------------------------------------------

# Set by `llmgw web` before anything imports prometheus_client, so that several web
# processes share one view of their counters.
PROMETHEUS_MULTIPROC_DIR = os.environ.get("PROMETHEUS_MULTIPROC_DIR", "")

# Logging ------------------------------------------------------------------------------

LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "formatters": {"plain": {"format": "%(asctime)s %(levelname)s %(name)s: %(message)s"}},
    "handlers": {"console": {"class": "logging.StreamHandler", "formatter": "plain"}},
    "root": {"handlers": ["console"], "level": (env_str("LLMGW_LOG_LEVEL") or "INFO").upper()},
    "loggers": {"django.db.backends": {"level": "WARNING"}},
}

# Security -----------------------------------------------------------------------------

SECURE_CONTENT_TYPE_NOSNIFF = True
X_FRAME_OPTIONS = "DENY"
SECURE_REFERRER_POLICY = "same-origin"
# Behind the TLS proxy, its X-Forwarded-* headers are believed (scheme, and the client address
# that accounts.throttle counts sign-ins by); otherwise they are ignored.
BEHIND_TLS_PROXY = env_bool("LLMGW_BEHIND_TLS_PROXY", False)
if BEHIND_TLS_PROXY:
    SECURE_PROXY_SSL_HEADER = ("HTTP_X_FORWARDED_PROTO", "https")

CSRF_FAILURE_VIEW = "apps.accounts.views.csrf_failure"
# Every page, the Django admin included, is served under this policy. No page has an inline
# script, style element, style attribute or on* handler (tests/llmgw/test_csp.py reads them
# all); htmx is a static file and its indicator <style> is turned off in base.html. A
# template that truly needs an inline script gives it nonce="{{ csp_nonce }}": the nonce
# appears in the header only on pages that use it. The one exception is /api/v1/docs,
# whose Swagger UI sets inline styles (llmgw/urls.py).
SECURE_CSP: dict[str, list[str]] = {
    "default-src": [CSP.SELF],
    "script-src": [CSP.SELF, CSP.NONCE],
    "style-src": [CSP.SELF],
    "img-src": [CSP.SELF, "data:"],
    "connect-src": [CSP.SELF],
    "font-src": [CSP.SELF],
    "object-src": [CSP.NONE],
    "base-uri": [CSP.SELF],
    "frame-ancestors": [CSP.NONE],
    "form-action": [CSP.SELF],
}

API_KEY_PREFIX = "llmgw_"
FIRST_ADMIN_EMAIL = env_str("LLMGW_ADMIN_EMAIL") or "admin@localhost"


# Single sign-on (OpenID Connect) ------------------------------------------------------

# On when LLMGW_OIDC_ISSUER is set. The provider's endpoints come from
# <issuer>/.well-known/openid-configuration, fetched on first use (apps.accounts.oidc.discover),
# so llmgw starts while the provider is down.
OIDC_ISSUER = (env_str("LLMGW_OIDC_ISSUER") or "").rstrip("/")
OIDC_PROVIDER_NAME = env_str("LLMGW_OIDC_NAME") or ""  # the sign-in button's; "single sign-on" when empty
OIDC_RP_CLIENT_ID = env_str("LLMGW_OIDC_CLIENT_ID") or ""
OIDC_RP_CLIENT_SECRET = env_secret("LLMGW_OIDC_CLIENT_SECRET")
OIDC_RP_SCOPES = " ".join((env_str("LLMGW_OIDC_SCOPES") or "openid email profile groups").split())
OIDC_GROUPS_CLAIM = env_str("LLMGW_OIDC_GROUPS_CLAIM") or "groups"
# Groups to a staff role and memberships: LLMGW_OIDC_ROLE_MAP (JSON) or LLMGW_OIDC_MAPPING_FILE (YAML).
OIDC_ROLE_MAP = load_role_map()
# Off: no password form, and every password refused (apps.accounts.oidc.LocalSignInGate).
LOCAL_SIGNIN = env_bool("LLMGW_LOCAL_SIGNIN", True)
if OIDC_ISSUER:
    if not OIDC_ISSUER.startswith(("https://", "http://")):
        raise ImproperlyConfigured(f"LLMGW_OIDC_ISSUER={OIDC_ISSUER!r}: expected a URL starting with https://")
    if not OIDC_RP_CLIENT_ID:
        raise ImproperlyConfigured("LLMGW_OIDC_ISSUER is set, so LLMGW_OIDC_CLIENT_ID is required")
    if not OIDC_RP_CLIENT_SECRET:
        raise ImproperlyConfigured("LLMGW_OIDC_ISSUER is set, so LLMGW_OIDC_CLIENT_SECRET (or _FILE) is required")
    if "openid" not in OIDC_RP_SCOPES.split():
        raise ImproperlyConfigured(f"LLMGW_OIDC_SCOPES={OIDC_RP_SCOPES!r}: must include openid")
    # Signing out POSTs to /logout/, which redirects to the provider's end-session endpoint;
    # browsers hold that redirect to the sign-out form's form-action.
    _issuer = urlsplit(OIDC_ISSUER)
    SECURE_CSP["form-action"] = [CSP.SELF, f"{_issuer.scheme}://{_issuer.netloc}"]
elif not LOCAL_SIGNIN:
    raise ImproperlyConfigured("LLMGW_LOCAL_SIGNIN is off and LLMGW_OIDC_ISSUER is not set: nobody could sign in")
OIDC_RP_SIGN_ALGO = "RS256"  # verified with the provider's JWKS
OIDC_USE_PKCE = True
OIDC_STORE_ID_TOKEN = True  # sent back as id_token_hint when signing out at the provider
OIDC_TIMEOUT = 10  # seconds, for every request to the provider
OIDC_AUTHENTICATE_CLASS = "apps.accounts.oidc.SsoAuthenticateView"
OIDC_CALLBACK_CLASS = "apps.accounts.oidc.SsoCallbackView"
OIDC_OP_LOGOUT_URL_METHOD = "apps.accounts.oidc.provider_logout_url"
LOGIN_REDIRECT_URL_FAILURE = "sso-failed"
AUTHENTICATION_BACKENDS = [
    "apps.accounts.oidc.LocalSignInGate",
    "django.contrib.auth.backends.ModelBackend",
    "apps.accounts.oidc.SsoBackend",
]

# The fleet simulator: where the captured files its node types name are looked up (after the
# scenario file's own folder), and the most steps a run from the console or the API may take.
SIM_CAPTURES_DIR = Path(env_str("LLMGW_SIM_CAPTURES") or DATA_DIR / "captures").expanduser().resolve()
SIM_MAX_WEB_STEPS = env_int("LLMGW_SIM_MAX_WEB_STEPS", 1441, minimum=1, maximum=100_000)
# What one run from the console or the API may ask (`llmgw sim` takes ten times as much): twice
# the largest fleet the project simulates itself (bench/sim.py: 10,000 nodes of 8 GPUs, 2,000
# models, a day of one-minute steps). A scenario past one is refused with the numbers, unbuilt.
SIM_MAX_NODES = env_int("LLMGW_SIM_MAX_NODES", 20_000, minimum=1, maximum=10_000_000)
SIM_MAX_GPUS = env_int("LLMGW_SIM_MAX_GPUS", 160_000, minimum=1, maximum=100_000_000)
SIM_MAX_MODELS = env_int("LLMGW_SIM_MAX_MODELS", 5_000, minimum=1, maximum=1_000_000)
SIM_MAX_REPLICAS = env_int("LLMGW_SIM_MAX_REPLICAS", 20_000, minimum=1, maximum=10_000_000)
SIM_MAX_EVENTS = env_int("LLMGW_SIM_MAX_EVENTS", 1_000, minimum=1, maximum=1_000_000)
SIM_MAX_SCENARIO_BYTES = env_int("LLMGW_SIM_MAX_SCENARIO_BYTES", 1024 * 1024, minimum=1024, maximum=1024**3)
# Runs from the console and the API go to the worker, which runs each in a child process held to
# a memory budget (its address space) and a wall-clock time, SIM_CONCURRENT_RUNS at once; one
# person may have SIM_MAX_QUEUED_PER_PERSON queued or running, and runs are kept SIM_KEEP_SECONDS.
SIM_MEMORY_MB = env_int("LLMGW_SIM_MEMORY_MB", 2048, minimum=64, maximum=1024 * 1024)
SIM_SECONDS = env_int("LLMGW_SIM_SECONDS", 300, minimum=1, maximum=86400)
SIM_CONCURRENT_RUNS = env_int("LLMGW_SIM_CONCURRENT_RUNS", 1, minimum=1, maximum=64)
SIM_MAX_QUEUED_PER_PERSON = env_int("LLMGW_SIM_MAX_QUEUED_PER_PERSON", 3, minimum=1, maximum=1000)
SIM_KEEP_SECONDS = env_int("LLMGW_SIM_KEEP_SECONDS", 86400, minimum=60, maximum=365 * 86400)
