#!/usr/bin/python3
"""trainctl export JOB -o DIR/ against a real traind: the directory holds model.safetensors and
a config.json that loads it elsewhere. For a gpt job, Hugging Face's GPT2Config of the job's
dimensions, and GPT-2's math over the directory alone (tests/gpt2_hf_dir.py, numpy) gives the
same greedy bytes as traind's `sample --temperature 0`; for a sensorlm job, every dimension.
Exits 77 (skipped) without numpy or the fortunes.

Usage: test_export_dir.py (TRAIND_BIN, TRAINCTL_BIN and TD_SOURCE_ROOT from meson's env)."""

import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import unittest

try:
    import numpy  # noqa: F401  (gpt2_hf_dir.py's)
except ImportError as e:
    print("skipped: %s (python3-numpy)" % e)
    sys.exit(77)

SRC = os.environ.get("TD_SOURCE_ROOT", ".")
TRAIND = os.environ.get("TRAIND_BIN", "build/daemon/traind")
TRAINCTL = os.environ.get("TRAINCTL_BIN", "build/client/trainctl")
FORTUNES = "/usr/share/games/fortunes"
DEADLINE_S = 300


class Daemon:
    def __init__(self):
        self.dir = tempfile.mkdtemp(prefix="traind-export.")
        self.sock = os.path.join(self.dir, "traind.sock")
        self.log = open(os.path.join(self.dir, "traind.log"), "w")
        self.proc = subprocess.Popen(
            [TRAIND, "--socket", self.sock, "--state-dir", self.dir, "--devices", "cpu:1"],
            stdout=subprocess.DEVNULL, stderr=self.log)
        until = time.monotonic() + 30
        while time.monotonic() < until:
            if self.proc.poll() is not None:
                raise RuntimeError("traind exited; see %s/traind.log" % self.dir)
            s = socket.socket(socket.AF_UNIX)
            try:
                s.connect(self.sock)
                return
            except OSError:
                time.sleep(0.02)
            finally:
                s.close()
        raise RuntimeError("traind did not listen")

    def tc(self, *args, check=True):
        r = subprocess.run([TRAINCTL, "--socket", self.sock, *args], capture_output=True,
                           timeout=DEADLINE_S)
        if check and r.returncode != 0:
            raise AssertionError("trainctl %s: %d %s" % (" ".join(args), r.returncode,
                                                         r.stderr.decode(errors="replace")))
        return r

    def stop(self):
        self.proc.terminate()
        self.proc.wait(30)
        self.log.close()
        shutil.rmtree(self.dir, ignore_errors=True)


D = None


def setUpModule():
    global D
    if not os.path.isdir(FORTUNES):
        raise unittest.SkipTest("fortunes is not installed")
    D = Daemon()


def tearDownModule():
    if D is not None:
        D.stop()


def submit(job):
    path = os.path.join(D.dir, "job-%s.json" % job["name"])
    with open(path, "w") as f:
        json.dump(job, f)
    jid = int(D.tc("submit", path).stdout)
    r = D.tc("watch", str(jid), check=False)
    assert r.returncode == 0, r.stderr.decode(errors="replace")
    return jid


class TestExportDir(unittest.TestCase):
    def test_gpt_dir_loads_as_gpt2(self):
        jid = submit({
            "name": "hfgpt",
            "model": {"kind": "gpt", "n_layer": 2, "n_head": 2, "n_embd": 32, "seq_len": 32,
                      "vocab_size": 256},
            "data": {"kind": "text", "train": [FORTUNES + "/*"], "valid_fraction": 0.05},
            "optim": {"lr": 3e-3},
            "batch_size": 4, "max_steps": 40, "seed": 3,
        })
        out = os.path.join(D.dir, "gpt-model") + "/"
        r = D.tc("export", str(jid), "-o", out)
        self.assertIn(b"model.safetensors", r.stderr)
        self.assertEqual(sorted(os.listdir(out)), ["config.json", "model.safetensors"])
        with open(out + "config.json") as f:
            cfg = json.load(f)
        want = {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "vocab_size": 256,
                "n_positions": 32, "n_ctx": 32, "n_embd": 32, "n_layer": 2, "n_head": 2,
                "activation_function": "gelu_new", "layer_norm_epsilon": 1e-5,
                "tie_word_embeddings": True}
        for k, v in want.items():
            self.assertEqual(cfg[k], v, k)
        self.assertEqual(cfg["traind"], {"job": jid, "step": 40})
        # the directory alone, through GPT-2's math, against traind's greedy sample
        ours = D.tc("sample", str(jid), "--prompt", "The cat ", "--tokens", "24",
                    "--temperature", "0").stdout
        theirs = subprocess.run([sys.executable, os.path.join(SRC, "tests", "gpt2_hf_dir.py"),
                                 out, "The cat ", "24"], capture_output=True, timeout=120)
        self.assertEqual(theirs.returncode, 0, theirs.stderr)
        self.assertEqual(theirs.stdout, ours, "margins: %s" % theirs.stderr.decode()[-400:])
        # an existing directory without the slash, and llmc refused for a directory
        D.tc("export", str(jid), "-o", out.rstrip("/"))
        r = D.tc("export", str(jid), "-o", out, "--format", "llmc", check=False)
        self.assertEqual(r.returncode, 64)
        self.assertIn(b"is a directory", r.stderr)

    def test_mlp_dir_scores_as_the_job_did(self):
        fm = "/usr/share/datasets/fashion-mnist"
        if not os.path.exists(fm + "/t10k-images-idx3-ubyte.gz"):
            self.skipTest("dataset-fashion-mnist is not installed")
        jid = submit({
            "name": "hfmlp",
            "model": {"kind": "mlp", "layers": [784, 32, 10]},
            "data": {"kind": "idx",
                     "train": {"images": fm + "/train-images-idx3-ubyte.gz",
                               "labels": fm + "/train-labels-idx1-ubyte.gz"},
                     "test": {"images": fm + "/t10k-images-idx3-ubyte.gz",
                              "labels": fm + "/t10k-labels-idx1-ubyte.gz"}},
            "optim": {"lr": 3e-3}, "batch_size": 64, "max_steps": 200, "eval_every": 200,
            "seed": 4,
        })
        out = os.path.join(D.dir, "mlp-model") + "/"
        D.tc("export", str(jid), "-o", out)
        with open(out + "config.json") as f:
            cfg = json.load(f)
        self.assertEqual(cfg["model_type"], "traind-mlp")
        self.assertEqual(cfg["layers"], [784, 32, 10])
        self.assertEqual(cfg["activation"], "relu")
        self.assertAlmostEqual(cfg["input"]["scale"], 1 / 255)
        self.assertEqual(cfg["input"]["offset"], 0)
        self.assertEqual(cfg["traind"], {"job": jid, "step": 200})
        # the directory alone, in numpy, on the test split, against the job's own accuracy
        import gzip
        import struct
        import numpy as np
        with open(out + "model.safetensors", "rb") as f:
            buf = f.read()
        (n,) = struct.unpack("<Q", buf[:8])
        head = json.loads(buf[8:8 + n])
        data = buf[8 + n:]
        w = {}
        for name, t in head.items():
            if name != "__metadata__":
                b, e = t["data_offsets"]
                w[name] = np.frombuffer(data[b:e], dtype="<f4").reshape(t["shape"]).astype(np.float64)
        with gzip.open(fm + "/t10k-images-idx3-ubyte.gz") as f:
            x = np.frombuffer(f.read()[16:], dtype=np.uint8).reshape(-1, 784)
        with gzip.open(fm + "/t10k-labels-idx1-ubyte.gz") as f:
            y = np.frombuffer(f.read()[8:], dtype=np.uint8)
        h = x * cfg["input"]["scale"] + cfg["input"]["offset"]
        nl = len(cfg["layers"]) - 1
        for layer in range(nl):
            h = h @ w["layers.%d.weight" % layer].T + w["layers.%d.bias" % layer]
            if layer + 1 < nl:
                h = np.maximum(h, 0)
        ours = float((h.argmax(1) == y).mean())
        st = json.loads(D.tc("status", str(jid), "--json").stdout)
        self.assertLessEqual(abs(ours - st["metrics"]["test_accuracy"]), 2e-4,
                             "numpy %.4f, traind %.4f" % (ours, st["metrics"]["test_accuracy"]))

    def test_sensorlm_dir_config_has_every_dimension(self):
        data = os.path.join(D.dir, "synth")
        r = subprocess.run([TRAINCTL, "sensor", "synth", "-o", data, "--days", "40", "--seed",
                            "2"], capture_output=True, timeout=120)
        self.assertEqual(r.returncode, 0, r.stderr)
        jid = submit({
            "name": "hfslm",
            "model": {"kind": "sensorlm", "size": "tiny",
                      "sensor": {"patch_t": 60, "patch_c": 10, "pool": "gap"},
                      "text": {"text_len": 22}},
            "data": {"kind": "sensor", "train": data + "/synth-train.bin"},
            "batch_size": 8, "max_steps": 2, "seed": 1,
        })
        out = os.path.join(D.dir, "slm-model") + "/"
        D.tc("export", str(jid), "-o", out)
        with open(out + "config.json") as f:
            cfg = json.load(f)
        self.assertEqual(cfg["model_type"], "traind-sensorlm")
        self.assertEqual((cfg["time_steps"], cfg["channels"], cfg["patch_t"], cfg["patch_c"],
                          cfg["text_len"]), (1440, 10, 60, 10, 22))
        self.assertEqual(cfg["sensor"]["pool"], "gap")
        for part in ("sensor", "text"):
            for k in ("d_model", "depth", "n_head", "mlp_dim"):
                self.assertGreater(cfg[part][k], 0, part + "." + k)
        self.assertGreater(cfg["embed_dim"], 0)
        self.assertEqual(cfg["traind"], {"job": jid, "step": 2})


if __name__ == "__main__":
    unittest.main(argv=[sys.argv[0], "-v"])
