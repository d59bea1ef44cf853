"""Starting and stopping the server a bench script measures (lossd, or bench/python_server.py),
shared by bench/user_step.py and bench/linear_step.py."""
import os
import signal
import subprocess
import time


def start_server(cmd, port_file, timeout=120):
    """Starts a server that writes its port to `port_file`; returns (process, address). It runs
    without PYTHONPATH: the lossd package there would hide the Python server's lossd.v1 stubs."""
    if os.path.exists(port_file):
        os.unlink(port_file)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    process = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                               env=env)
    deadline = time.time() + timeout
    while time.time() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"{cmd[0]} exited: {process.stderr.read()[-3000:]}")
        try:
            with open(port_file) as f:
                port = int(f.read().strip() or 0)
            if port > 0:
                return process, f"127.0.0.1:{port}"
        except (FileNotFoundError, ValueError):
            pass
        time.sleep(0.05)
    process.kill()
    raise RuntimeError(f"{cmd[0]} did not start in {timeout} s")


def stop(process):
    """SIGTERM (lossd drains), then SIGKILL after a minute."""
    process.send_signal(signal.SIGTERM)
    try:
        process.wait(timeout=60)
    except subprocess.TimeoutExpired:
        process.kill()
