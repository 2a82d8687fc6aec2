"""python3 exit_loop.py N CODE_DIR: run tests/runtime_exit_script.py (2 gloo ranks, zb-h1, no
close, no destroy_process_group) N times with pipetrain from CODE_DIR; count non-zero exits."""
import os, socket, subprocess, sys, time
from concurrent.futures import ThreadPoolExecutor
n, code = int(sys.argv[1]), os.path.abspath(sys.argv[2])
script = os.path.abspath("tests/runtime_exit_script.py")
def port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0)); return s.getsockname()[1]
def one(i):
    p = str(port())
    procs = [subprocess.Popen([sys.executable, script, "plain"], env=dict(os.environ, PYTHONPATH=code, MASTER_ADDR="127.0.0.1", MASTER_PORT=p, RANK=str(r), WORLD_SIZE="2", LOCAL_RANK=str(r), PIPETRAIN_SCHEDULE="zb-h1"), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, cwd="/tmp") for r in range(2)]
    out = []
    for pr in procs:
        try:
            _, err = pr.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            pr.kill(); _, err = pr.communicate()
        out.append((pr.returncode, err.strip().splitlines()[-1:] if pr.returncode else []))
    return out
t0 = time.time()
with ThreadPoolExecutor(6) as ex:
    res = list(ex.map(one, range(n)))
bad = [r for r in res if any(c for c, _ in r)]
print(f"{code}: {len(bad)}/{n} runs with a non-zero exit, {time.time() - t0:.1f} s")
for r in bad: print(r)
