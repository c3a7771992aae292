"""Router configuration: defaults, TOML < environment < CLI precedence, unknown keys rejected with clear errors."""

from __future__ import annotations

from pathlib import Path

import pytest

from switchyard.router.config import ConfigError, RouterConfig, load_config
from switchyard.router.server import config_from_args


def write(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "router.toml"
    p.write_text(text)
    return p


def test_defaults() -> None:
    c = load_config(environ={})
    assert (c.server.host, c.server.admin_host) == ("127.0.0.1", "127.0.0.1")
    assert c.routing.policy == "switchyard"
    assert c.workers.stats_interval_s == 0.2
    assert c.queue.kv_usage_hold_frac == 0.95
    assert c.workers.addresses == ()


def test_frozen() -> None:
    c = load_config(environ={})
    with pytest.raises(Exception, match="frozen"):
        c.server.port = 1  # type: ignore[misc]


def test_precedence_toml_then_env_then_cli(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        """
[server]
port = 6000
admin_port = 6001
grace_s = 5
[workers]
addresses = ["a:1", "b:2"]
[routing]
policy = "round_robin"
[tokenizer.models]
m1 = "/tmp/m1.model"
""",
    )
    env = {"SWITCHYARD_SERVER_ADMIN_PORT": "7001", "SWITCHYARD_SERVER_GRACE_S": "9.5", "SWITCHYARD_WORKERS_ADDRESSES": "c:3,d:4"}
    c = config_from_args(["--config", str(path), "--admin-port", "8001", "--set", "queue.max_size=7"], environ=env)
    assert c.server.port == 6000  # TOML only
    assert c.server.admin_port == 8001  # TOML 6001 < env 7001 < CLI 8001
    assert c.server.grace_s == 9.5  # env over TOML
    assert c.workers.addresses == ("c:3", "d:4")  # env list replaces the TOML list
    assert c.routing.policy == "round_robin"
    assert c.queue.max_size == 7
    assert c.tokenizer.models == {"m1": "/tmp/m1.model"}


def test_named_cli_flag_wins_over_set() -> None:
    c = config_from_args(["--set", "server.port=1", "--port", "2", "--worker", "x:1", "--worker", "y:2,z:3"], environ={})
    assert c.server.port == 2
    assert c.workers.addresses == ("x:1", "y:2", "z:3")


def test_env_json_values() -> None:
    c = load_config(environ={"SWITCHYARD_TOKENIZER_MODELS": '{"m": "/p.model"}', "SWITCHYARD_WORKERS_ADDRESSES": '["a:1"]'})
    assert c.tokenizer.models == {"m": "/p.model"} and c.workers.addresses == ("a:1",)


def test_unrelated_switchyard_env_vars_are_ignored() -> None:
    c = load_config(environ={"SWITCHYARD_NO_EXTENSIONS": "1", "HOME": "/root"})
    assert c == RouterConfig()


@pytest.mark.parametrize(
    ("toml", "message"),
    [
        ("[server]\nprot = 1\n", r"unknown key server\.prot; known keys of \[server\]: host, port"),
        ("[sever]\nport = 1\n", r"unknown section \[sever\]"),
        ("[routing]\npolicy = 'nope'\n", r"unknown policy 'nope'; known: .*least_request.*round_robin"),
        ("[server]\nport = 'abc'\n", r"server\.port: Input should be a valid integer"),
        ("[queue]\nkv_usage_hold_frac = 1.5\n", r"queue\.kv_usage_hold_frac"),
        ("[workers]\nstats_interval_s = inf\n", r"workers\.stats_interval_s: Input should be a finite number"),
        ("[server]\ngrace_s = nan\n", r"server\.grace_s: Input should be a finite number"),
        ("[server]\nstream_interval_tokens = 4\nstream_interval_max_tokens = 2\n",
         r"server\.stream_interval_max_tokens must be 0 \(off\) or >= server\.stream_interval_tokens"),
        ("[server]\nstream_lag_target_ms = 0\n", r"server\.stream_lag_target_ms"),
        ("[server]\nkeepalive_timeout_s = 0\n", r"server\.keepalive_timeout_s: Input should be greater than 0"),
        ("[workers]\nkeepalive_time_s = 1\n",
         r"workers\.keepalive_time_s must be 0 \(off\) or >= 5: workers answer pings more frequent than that with "
         "GOAWAY too_many_pings"),
        ("[workers]\nkeepalive_timeout_s = 0\n", r"workers\.keepalive_timeout_s: Input should be greater than 0"),
        ("[server\n", r"config file .*router\.toml"),
    ],
)
def test_toml_errors_are_clear(tmp_path: Path, toml: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        load_config(write(tmp_path, toml), environ={})


def test_unknown_env_key_in_known_section_is_rejected() -> None:
    with pytest.raises(ConfigError, match=r"SWITCHYARD_QUEUE_MAXSIZE: unknown key queue\.maxsize"):
        load_config(environ={"SWITCHYARD_QUEUE_MAXSIZE": "3"})


def test_unknown_set_key_is_rejected() -> None:
    with pytest.raises(ConfigError, match=r"--set: unknown key limits\.max_token\b"):
        config_from_args(["--set", "limits.max_token=5"], environ={})
    with pytest.raises(ConfigError, match="expected section.key=value"):
        config_from_args(["--set", "limits"], environ={})


def test_missing_file() -> None:
    with pytest.raises(ConfigError, match="cannot read config file /nonexistent.toml"):
        load_config("/nonexistent.toml", environ={})


def test_print_config_round_trips(tmp_path: Path) -> None:
    from switchyard.router.config import to_toml

    c = config_from_args(["--worker", "a:1", "--set", 'tokenizer.models={"m": "/x.model"}', "--port", "7"], environ={})
    path = write(tmp_path, to_toml(c))
    assert load_config(path, environ={}) == c


def test_policy_params_merge_across_sources_and_reach_the_policy(tmp_path: Path) -> None:
    from switchyard.router.policies.registry import make_policy, policy_params

    path = write(tmp_path, "[routing]\npolicy = 'switchyard'\n[routing.params]\nexternality_weight = 0.5\nt_mem = 0.7\n")
    env = {"SWITCHYARD_ROUTING_PARAMS": '{"horizon": 50}'}
    c = config_from_args(["--config", str(path), "--set", "routing.params.externality_weight=1"], environ=env)
    # tables merge key by key: the file's t_mem, the environment's horizon, the command line's weight
    assert c.routing.params == {"externality_weight": "1", "t_mem": 0.7, "horizon": 50}
    knobs = policy_params(make_policy(c.routing.policy, c.routing.params))
    assert (knobs["externality_weight"], knobs["t_mem"], knobs["horizon"]) == (1.0, 0.7, 50)
    assert knobs["queue_weight"] == 1.0  # untouched knobs keep their defaults


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--set", "routing.params.externality_wieght=1"], r"policy 'switchyard': externality_wieght: Extra inputs"),
        (["--set", "routing.params.externality_weight=-1"], r"externality_weight: Input should be greater than"),
        (["--set", "routing.policy=preserve", "--set", "routing.params.horizon=soon"], r"horizon expects int"),
        (["--set", "routing.policy=round_robin", "--set", "routing.params.x=1"], r"'round_robin' has no parameters"),
        (["--set", "routing.tick_interval_ms.x=1"], r"routing\.tick_interval_ms is not a table"),
    ],
)
def test_bad_policy_params_fail_at_load(argv: list[str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        config_from_args(argv, environ={})


def test_the_daemon_builds_its_policy_with_the_configured_params() -> None:
    from switchyard.router.server import RouterDaemon

    c = config_from_args(["--set", "routing.params.externality_weight=1", "--set", "routing.params.t_mem=0.9"], environ={})
    daemon = RouterDaemon(c)
    assert (daemon.policy.name, daemon.policy.sy.externality_weight, daemon.policy.sy.t_mem) == ("switchyard", 1.0, 0.9)
