"""A coordinator port already in use is an error naming the port (exit 2), found before
jax.distributed tries it (JAX's own failure there is a native crash of process 0)."""

import socket
import subprocess

from test_multihost import PY, ROOT, env, train_cmd


def test_a_coordinator_port_in_use_is_an_error_naming_it():
  with socket.socket() as taken:
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    port = taken.getsockname()[1]
    out = subprocess.run(train_cmd(2, "--coordinator", f"127.0.0.1:{port}", "--num-processes",
                                   "2", "--process-id", "0", "--init-timeout", "20"),
                         capture_output=True, text=True, env=env(), cwd=ROOT, timeout=120)
    assert out.returncode == 2, out.stdout + out.stderr
    assert (f"error: --coordinator 127.0.0.1:{port}: port {port} is already in use on this "
            f"host") in out.stderr, out.stderr
    assert "Choose a free port for every process" in out.stderr
    assert "Traceback" not in out.stderr

    launched = subprocess.run([PY, "-m", "shardlab.cli", "launch", "-n", "2", "--port",
                               str(port), "--", PY, "-c", "pass"],
                              capture_output=True, text=True, env=env(), cwd=ROOT, timeout=60)
    assert launched.returncode == 2, launched.stdout + launched.stderr
    assert f"error: --port {port} is already in use on this host" in launched.stderr
