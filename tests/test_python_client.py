#!/usr/bin/python3
"""The Python client (python/traind) against a real traind: submit (a dict, a job file with
relative paths and keywords), watch to the end with every row once, metrics as rows and as a
DataFrame, status, jobs with filters, logs, cancel, and errors as traind.Error with the
daemon's code names; then `pip install ./python` offline into a fresh venv and the installed
package imported from there. Exits 77 (skipped) where msgpack is missing.

Usage: test_python_client.py BUILD_DIR (TRAIND_BIN and TD_SOURCE_ROOT from meson's test env)."""

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import unittest

SRC = os.environ.get("TD_SOURCE_ROOT", os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(SRC, "python"))
try:
    import traind
except ImportError as e:  # msgpack missing
    print("skipped: %s (install python3-msgpack)" % e)
    sys.exit(77)

FMNIST = "/usr/share/datasets/fashion-mnist"
TRAIND = os.environ.get("TRAIND_BIN", "build/daemon/traind")
STEPS = 40
DEADLINE_S = 120


def mlp_job(name, steps=STEPS, **extra):
    job = {
        "name": name,
        "model": {"kind": "mlp", "layers": [784, 32, 10]},
        "data": {"kind": "idx", "train": {"images": FMNIST + "/train-images-idx3-ubyte.gz",
                                          "labels": FMNIST + "/train-labels-idx1-ubyte.gz"}},
        "optim": {"lr": 1e-3},
        "batch_size": 32,
        "max_steps": steps,
        "seed": 5,
    }
    job.update(extra)
    return job


class Daemon:
    """A traind of the test's own, on a temporary socket and state directory."""

    def __init__(self):
        self.dir = tempfile.mkdtemp(prefix="traind-py.")
        self.sock = os.path.join(self.dir, "traind.sock")
        self.log = open(os.path.join(self.dir, "traind.log"), "w")
        self.proc = subprocess.Popen(
            [TRAIND, "--socket", self.sock, "--state-dir", self.dir, "--devices", "cpu:1"],
            stdout=subprocess.DEVNULL, stderr=self.log)
        until = time.monotonic() + 30
        while time.monotonic() < until:
            if self.proc.poll() is not None:
                raise RuntimeError("traind exited (%d); see %s/traind.log"
                                   % (self.proc.returncode, self.dir))
            s = socket.socket(socket.AF_UNIX)
            try:
                s.connect(self.sock)
                return
            except OSError:
                time.sleep(0.02)
            finally:
                s.close()
        raise RuntimeError("traind did not listen on %s" % self.sock)

    def stop(self):
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.close()
        shutil.rmtree(self.dir, ignore_errors=True)


D = None


def setUpModule():
    global D
    if not os.path.exists(FMNIST + "/train-images-idx3-ubyte.gz"):
        raise unittest.SkipTest("dataset-fashion-mnist is not installed")
    D = Daemon()


def tearDownModule():
    if D is not None:
        D.stop()


def wait_state(c, job, want):
    until = time.monotonic() + DEADLINE_S
    while True:
        st = c.status(job)
        if st["state"] == want:
            return st
        if time.monotonic() > until:
            break
        time.sleep(0.05)
    raise AssertionError("job %d is %s, not %s, after %d s" % (job, st["state"], want, DEADLINE_S))


class TestClient(unittest.TestCase):
    def setUp(self):
        self.c = traind.Client(socket=D.sock, timeout=DEADLINE_S)

    def tearDown(self):
        self.c.close()

    def test_submit_watch_metrics_status(self):
        job = self.c.submit(mlp_job("py-watch"))
        w = self.c.watch(job)
        rows = list(w)
        self.assertEqual(w.job["state"], "succeeded")
        self.assertEqual(w.job["id"], job)
        seen = [(r["key"], r["step"]) for r in rows]
        self.assertEqual(len(seen), len(set(seen)), "a row came twice")
        self.assertEqual([st for _, st in seen], sorted(st for _, st in seen), "out of step order")
        steps = [r["step"] for r in rows if r["key"] == "train_loss"]
        self.assertEqual(steps, list(range(1, STEPS + 1)))
        # The stored rows are the watched ones, row for row.
        listed = self.c.metrics(job, frame=False)
        self.assertEqual([(r["key"], r["step"], r["value"]) for r in listed],
                         [(r["key"], r["step"], r["value"]) for r in rows])
        loss = self.c.metrics(job, keys=["train_loss"], frame=False)
        self.assertEqual([r["value"] for r in loss],
                         [r["value"] for r in rows if r["key"] == "train_loss"])
        try:
            import pandas
        except ImportError:
            pandas = None
        if pandas is not None:
            df = self.c.metrics(job, keys=["train_loss", "lr"])
            self.assertIsInstance(df, pandas.DataFrame)
            self.assertEqual(list(df.columns), ["key", "step", "value", "time"])
            self.assertEqual(len(df[df.key == "train_loss"]), STEPS)
            self.assertEqual(list(df[df.key == "train_loss"].value),
                             [r["value"] for r in loss])
        with self.assertWarnsRegex(UserWarning, "no rows of bogus_key"):
            self.c.metrics(job, keys=["bogus_key"], frame=False)
        st = self.c.status(job)
        self.assertEqual((st["state"], st["step"], st["total_steps"]), ("succeeded", STEPS, STEPS))
        self.assertEqual(st["spec"]["name"], "py-watch")
        self.assertAlmostEqual(st["metrics"]["train_loss"], loss[-1]["value"])
        lines = self.c.logs(job)
        self.assertTrue(any("queued" in m for _, _, m in lines), lines)
        self.assertTrue(all(len(line) == 3 for line in lines))

    def test_job_file_relative_paths_and_keywords(self):
        d = tempfile.mkdtemp(prefix="traind-pyjob.")
        try:
            job = mlp_job("py-file", steps=1000)
            job["data"]["train"] = {"images": "fashion-mnist/train-images-idx3-ubyte.gz",
                                    "labels": "./fashion-mnist/train-labels-idx1-ubyte.gz"}
            path = os.path.join(d, "job.json")
            with open(path, "w") as f:
                json.dump(job, f)
            here = os.getcwd()
            os.chdir(os.path.dirname(FMNIST))
            try:
                jid = self.c.submit(path, max_steps=3, optim__lr=2e-3, name="py-file-set")
            finally:
                os.chdir(here)
            st = wait_state(self.c, jid, "succeeded")
            self.assertEqual(st["total_steps"], 3)
            self.assertEqual(st["name"], "py-file-set")
            self.assertEqual(st["spec"]["optim"]["lr"], 2e-3)
            self.assertEqual(st["spec"]["data"]["train"]["images"],
                             FMNIST + "/train-images-idx3-ubyte.gz")
            self.assertEqual(st["spec"]["data"]["train"]["labels"],
                             FMNIST + "/train-labels-idx1-ubyte.gz")
        finally:
            shutil.rmtree(d)

    def test_jobs_filters_and_cancel(self):
        held = self.c.submit(mlp_job("py-held", steps=1000, debug={"hold": {"step": 2}}))
        until = time.monotonic() + DEADLINE_S
        while self.c.status(held)["step"] < 2:  # held after its step 2 until cancelled
            self.assertLess(time.monotonic(), until, "job %d never reached step 2" % held)
            time.sleep(0.05)
        ids = [j["id"] for j in self.c.jobs(state="running")]
        self.assertIn(held, ids)
        self.assertIn(held, [j["id"] for j in self.c.jobs(name="py-he*")])
        self.assertNotIn(held, [j["id"] for j in self.c.jobs(name="nomatch-*")])
        self.assertIn(held, [j["id"] for j in self.c.jobs(user=os.getuid())])
        import pwd
        self.assertIn(held, [j["id"] for j in self.c.jobs(user=pwd.getpwuid(os.getuid()).pw_name)])
        self.assertNotIn(held, [j["id"] for j in self.c.jobs(state=["succeeded", "failed"])])
        labelled = self.c.submit(mlp_job("py-labelled", steps=1, labels={"team": "py"}))
        self.assertEqual([j["id"] for j in self.c.jobs(labels={"team": "py"})], [labelled])
        self.assertEqual(self.c.jobs(labels={"team": "py"})[0]["labels"], {"team": "py"})
        self.assertEqual(self.c.jobs(labels={"team": "other"}), [])
        self.assertIn(self.c.cancel(held), ("running", "cancelled"))
        w = self.c.watch(held, keys=["train_loss"])
        rows = list(w)
        self.assertEqual(w.job["state"], "cancelled")
        self.assertEqual([r["step"] for r in rows], [1, 2])
        with self.assertRaises(traind.Error) as e:
            self.c.cancel(held)
        self.assertEqual(e.exception.code, "ESTATE")

    def test_errors_carry_code_names(self):
        with self.assertRaises(traind.Error) as e:
            self.c.status(987654)
        self.assertEqual((e.exception.code, e.exception.message), ("ENOTFOUND", "no job 987654"))
        self.assertEqual(e.exception.errno, -4205)
        with self.assertRaises(traind.Error) as e:
            self.c.submit(mlp_job("py-bad", batch_size=-1))
        self.assertEqual(e.exception.code, "EJOB")
        self.assertIn("batch_size", e.exception.message)
        with self.assertRaises(traind.Error) as e:
            self.c.jobs(state="sleeping")
        self.assertEqual(e.exception.code, "EINVAL")
        # The connection stays usable after an error the daemon answered.
        self.assertIsInstance(self.c.jobs(), list)
        with self.assertRaises(traind.Error) as e:
            traind.Client(socket=os.path.join(D.dir, "nothing.sock"))
        self.assertEqual(e.exception.code, "ECLOSED")
        self.assertIn("nothing.sock", e.exception.message)

    def test_default_socket_from_environment(self):
        old = os.environ.get("TRAIND_SOCKET")
        os.environ["TRAIND_SOCKET"] = D.sock
        try:
            with traind.Client() as c:
                self.assertEqual(c.socket_path, D.sock)
                self.assertIn("dry_run", c.features)
                est = c.submit(mlp_job("py-dry"), dry_run=True)
                self.assertEqual(est["type"], "estimate")
                self.assertTrue(est["fits"])
        finally:
            if old is None:
                del os.environ["TRAIND_SOCKET"]
            else:
                os.environ["TRAIND_SOCKET"] = old


class TestInstall(unittest.TestCase):
    def test_pip_install_offline(self):
        py = "/usr/bin/python3"
        if subprocess.run([py, "-m", "pip", "--version"], capture_output=True).returncode != 0:
            self.skipTest("no pip for %s (python3-pip)" % py)
        d = tempfile.mkdtemp(prefix="traind-pyvenv.")
        try:
            venv = os.path.join(d, "venv")
            subprocess.run([py, "-m", "venv", "--without-pip", "--system-site-packages", venv],
                           check=True)
            vpy = os.path.join(venv, "bin", "python")
            r = subprocess.run([py, "-m", "pip", "--python", vpy, "install", "--no-index",
                                "--no-cache-dir", os.path.join(SRC, "python")],
                               capture_output=True, text=True)
            self.assertEqual(r.returncode, 0, r.stdout + r.stderr)
            r = subprocess.run([vpy, "-c", "import traind; print(traind.__file__); "
                                "print(traind.Client.__doc__ is not None)"],
                               capture_output=True, text=True, cwd=d)
            self.assertEqual(r.returncode, 0, r.stderr)
            self.assertTrue(r.stdout.startswith(venv), r.stdout)
        finally:
            shutil.rmtree(d)


if __name__ == "__main__":
    unittest.main(argv=[sys.argv[0], "-v"])
