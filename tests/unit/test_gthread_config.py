"""A web worker reads gunicorn's settings as plain attributes (web/gthread.py,
``settle_config``): the same values, Config's own properties unchanged, and no call to
Config.__getattr__ per read; and the parser those settings choose is gunicorn_h1c's
(web/server.py)."""

from __future__ import annotations

from gunicorn.config import Config
from gunicorn.workers.gthread import ThreadWorker

from runstile.web.gthread import settle_config


class _CountingConfig(Config):
    """gunicorn's Config, counting the reads that go through its __getattr__."""

    def __getattr__(self, name):
        if name not in ("settings", "getattr_calls"):
            self.__dict__["getattr_calls"] = self.__dict__.get("getattr_calls", 0) + 1
        return super().__getattr__(name)


def test_settings_read_after_settling_are_the_configs_values_without_its_getattr():
    cfg = _CountingConfig()
    cfg.set("keepalive", 7)
    cfg.set("worker_class", "gthread")
    cfg.set("limit_request_line", 1234)
    before = {name: getattr(cfg, name) for name in cfg.settings}
    assert cfg.getattr_calls > 0

    settle_config(cfg)
    cfg.__dict__["getattr_calls"] = 0
    after = {name: getattr(cfg, name) for name in cfg.settings}

    assert after == before
    assert (cfg.keepalive, cfg.limit_request_line) == (7, 1234)
    assert cfg.getattr_calls == 0
    # A property of Config's with a setting's name still answers as the property does.
    assert cfg.worker_class is ThreadWorker


def test_the_web_tier_parses_requests_with_gunicorns_c_parser(tmp_path):
    from gunicorn.http.message import _check_fast_parser

    from runstile.config import Settings
    from runstile.web.server import _Gunicorn

    app = _Gunicorn(Settings.from_env({"RUNSTILE_DATA_DIR": str(tmp_path)}),
                    writer_socket=None, metrics_dir=str(tmp_path))
    assert app.cfg.http_parser == "fast"
    # gunicorn's own test of whether a request would go through gunicorn_h1c.
    assert _check_fast_parser(app.cfg) is True
