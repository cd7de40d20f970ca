#!/usr/bin/python3
"""trainctl watch as a pipe sees it, against a fake traind that replays scripted rows: one line
per step as llm.c prints it (`step 12/100 | loss 2.31 | 10.0 ms | 5,930 tok/s | ETA 18s`), one
per evaluation, a state line only when the state changes; the ETA from the moving averages of
the rows' own times (a step's wall time apart from the evaluation pauses, and those pauses),
not from samples_per_s or the last step alone; and the end line of a sensorlm job naming its
evaluation (zeroshot_accuracy, the recalls). Exits 77 (skipped) where msgpack is missing.

Usage: test_watch_lines.py (TRAINCTL_BIN from meson's test env)."""

import os
import re
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import unittest

try:
    import msgpack
except ImportError as e:
    print("skipped: %s (install python3-msgpack)" % e)
    sys.exit(77)

TRAINCTL = os.environ.get("TRAINCTL_BIN", "build/client/trainctl")
T0 = 1_800_000_000.0
STEP_S = 0.1  # wall time of a step
EVAL_S = 2.0  # an evaluation's pause
SLOW_STEP = 45  # one step that takes SLOW_S instead
SLOW_S = 1.1
LAST = 50


def gpt_rows(total, last):
    """(rows, spec): steps 1..last of a gpt job of total steps, evaluated every 10."""
    rows, t = [], T0
    for s in range(1, last + 1):
        t += SLOW_S if s == SLOW_STEP else STEP_S
        rows += [["train_loss", s, 3.0 - s / 100, t], ["lr", s, 3e-4, t],
                 ["step_ms", s, 10.0, t], ["tokens_per_s", s, 5930.4, t]]
        if s % 10 == 0:
            t += EVAL_S
            rows.append(["valid_loss", s, 2.5 - s / 200, t])
    spec = {"name": "g", "model": {"kind": "gpt"}, "batch_size": 8, "max_steps": total,
            "eval_every": 10, "data": {"kind": "text", "valid_fraction": 0.1}}
    return rows, spec


def reference_eta(rows, total, eval_every):
    """The ETA the watch's documented averages give after the last row (trainctl(1))."""
    step_s = eval_s = None
    nrate = neval = 0
    last_step, last_t, pause = -1, 0.0, 0.0
    for key, s, v, t in rows:
        ev = key.startswith(("valid_", "test_", "val_", "recall_at_", "zeroshot_"))
        if ev:
            if s == last_step and t - last_t > pause:
                pause = t - last_t
            continue
        if s <= last_step:
            continue
        if last_step >= 0:
            k = s - last_step
            if pause > 0:
                eval_s = pause if neval == 0 else eval_s + 0.5 * (pause - eval_s)
                neval += 1
            x = (t - last_t - pause) / k
            if not (nrate >= 8 and x > 20 * step_s):
                w = 1 - (1 - 0.1) ** k
                step_s = x if nrate == 0 else step_s + w * (x - step_s)
                nrate += 1
        last_step, last_t, pause = s, t, 0.0
    evals_left = total // eval_every - last_step // eval_every + (total % eval_every != 0)
    return (total - last_step) * step_s + evals_left * (eval_s or 0)


class Fake(threading.Thread):
    """A traind that answers hello, status (JOB) and watch (rows, a state frame, end)."""

    def __init__(self, path, job, rows, end_job):
        super().__init__(daemon=True)
        self.job, self.rows, self.end_job = job, rows, end_job
        self.srv = socket.socket(socket.AF_UNIX)
        self.srv.bind(path)
        self.srv.listen(4)

    def send(self, c, m):
        b = msgpack.packb(m, use_bin_type=True)
        c.sendall(struct.pack(">I", len(b)) + b)

    def run(self):
        c, _ = self.srv.accept()
        try:
            self.serve(c)
        finally:
            c.close()
            self.srv.close()

    def serve(self, c):
        buf = b""
        while True:
            while len(buf) < 4 or len(buf) < 4 + struct.unpack(">I", buf[:4])[0]:
                more = c.recv(65536)
                if not more:
                    return
                buf += more
            n = struct.unpack(">I", buf[:4])[0]
            req, buf = msgpack.unpackb(buf[4:4 + n], raw=False), buf[4 + n:]
            rid, t = req["id"], req["type"]
            if t == "hello":
                self.send(c, {"type": "hello", "id": rid, "version": 1, "server": "fake",
                              "features": []})
            elif t == "status":
                self.send(c, {"type": "job", "id": rid, "job": self.job})
            elif t == "watch":
                for i in range(0, len(self.rows), 37):  # frames that cut steps apart
                    self.send(c, {"type": "rows", "id": rid, "job_id": 1,
                                  "rows": self.rows[i:i + 37]})
                self.send(c, {"type": "state", "id": rid, "job_id": 1, "state": "running",
                              "step": self.job["step"], "total_steps": self.job["total_steps"]})
                self.send(c, {"type": "end", "id": rid, "job_id": 1, "job": self.end_job})


def job_map(state, step, total, spec, metrics=None):
    return {"id": 1, "name": spec["name"], "uid": 0, "state": state, "step": step,
            "total_steps": total, "devices": 1, "device_list": "cpu:0", "created": T0,
            "started": T0, "ended": 0, "error": None, "metrics": metrics or {}, "spec": spec}


def watch(job, rows, end_job):
    d = tempfile.mkdtemp(prefix="trainctl-watch.")
    path = os.path.join(d, "fake.sock")
    f = Fake(path, job, rows, end_job)
    f.start()
    r = subprocess.run([TRAINCTL, "--socket", path, "watch", "1"], capture_output=True,
                       text=True, timeout=60)
    f.join(30)
    os.unlink(path)
    os.rmdir(d)
    return r


class TestWatchLines(unittest.TestCase):
    def test_one_line_per_step_and_a_smoothed_eta(self):
        total = 100
        rows, spec = gpt_rows(total, LAST)
        job = job_map("running", LAST, total, spec)
        end = job_map("cancelled", LAST, total, spec)
        r = watch(job, rows, end)
        lines = r.stdout.splitlines()
        sys.stderr.write(r.stdout[-600:])
        for s in range(1, LAST + 1):
            mine = [ln for ln in lines if ln.startswith("step %d/%d |" % (s, total))]
            want = 2 if s % 10 == 0 else 1
            self.assertEqual(len(mine), want, "step %d: %s" % (s, mine))
            self.assertRegex(mine[0], r"^step %d/%d \| loss [0-9.]+ \| 10\.0 ms \| 5,930 tok/s"
                                      r" \| ETA \S+$" % (s, total))
        self.assertIn("step 10/100 | valid_loss 2.45", lines)
        self.assertEqual(sum(ln.startswith("state ") for ln in lines), 1, lines[:3])
        eta = re.search(r"ETA (?:(\d+)m)?(\d+)s$",
                        [ln for ln in lines if ln.startswith("step %d/" % LAST)][0])
        shown = int(eta.group(1) or 0) * 60 + int(eta.group(2))
        want = reference_eta(rows, total, 10)
        # 50 steps at the averaged 0.16 s and 5 evaluations at 2 s: about 18 s. The old
        # estimate (samples_per_s's 10 ms a step) said 10 s, the last step alone 15 s.
        print("ETA at step %d: shown %d s, the averages' %.2f s" % (LAST, shown, want))
        self.assertLessEqual(abs(shown - want), 0.5 + 1e-9)
        self.assertGreater(want, 16)

    def test_sensorlm_end_line_names_its_evaluation(self):
        spec = {"name": "s", "model": {"kind": "sensorlm"}, "batch_size": 64, "max_steps": 2,
                "eval_every": 1, "data": {"kind": "sensor", "valid": "/v.bin"}}
        rows = [["train_loss", 1, 1.5, T0 + 1], ["recall_at_1", 1, 0.25, T0 + 2],
                ["zeroshot_accuracy", 1, 0.75, T0 + 2]]
        metrics = {"train_loss": 1.25, "valid_loss": 1.5, "recall_at_1": 0.25,
                   "recall_at_5": 0.5, "text_recall_at_1": 0.125, "zeroshot_accuracy": 0.75}
        r = watch(job_map("running", 1, 2, spec), rows,
                  job_map("succeeded", 2, 2, spec, metrics))
        self.assertEqual(r.returncode, 0, r.stderr)
        last = r.stdout.splitlines()[-1]
        for k in ("zeroshot_accuracy 0.75", "recall_at_1 0.25", "recall_at_5 0.5",
                  "text_recall_at_1 0.125", "train_loss 1.25"):
            self.assertIn(k, last)
        self.assertIn("step 1/2 | recall_at_1 0.25 | zeroshot_accuracy 0.75", r.stdout)


if __name__ == "__main__":
    unittest.main(argv=[sys.argv[0], "-v"])
