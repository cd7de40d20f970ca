"""traind's control socket from Python, written from proto/PROTOCOL.md alone.

One Client is one connection: frames of a 4-byte big-endian length and a msgpack map, a
hello first, then requests each with an id of the client's own, answered in order. Every
error frame becomes a traind.Error carrying the daemon's code and its symbolic name.
"""

import json
import os
import pwd
import socket as _socket
import struct
import warnings

import msgpack

__all__ = ["Client", "Error", "DEFAULT_SOCKET", "CODES"]

DEFAULT_SOCKET = "/run/traind/traind.sock"
PROTOCOL_VERSION = 1
FRAME_MAX = 1 << 20  # PROTOCOL.md, "Limits": a frame's body, in bytes, either way
LIST_PAGE = 1000  # jobs in one list page, the most a request may ask
LOGS_PAGE = 1000  # lines in one logs page
STATES = ("queued", "running", "succeeded", "failed", "cancelled")
ENDED = ("succeeded", "failed", "cancelled")

# common/td_errno.h: the daemon's codes by name (an error frame carries both).
CODES = {
    "EINVAL": -4200, "ENOMEM": -4201, "EIO": -4202, "EPROTO": -4203, "E2BIG": -4204,
    "ENOTFOUND": -4205, "EJOB": -4206, "EDATA": -4207, "ESHAPE": -4208, "ENAN": -4209,
    "ESTORE": -4210, "EDISKFULL": -4211, "ECANCELLED": -4212, "EPANIC": -4213,
    "ECUDA": -4214, "EPERM": -4215, "ESTATE": -4216, "EVERSION": -4217, "ECLOSED": -4218,
    "EWORKERS": -4219, "EABORTED": -4220, "EBUSY": -4221, "EMPI": -4222,
}
_NAMES = {v: k for k, v in CODES.items()}


class Error(Exception):
    """An error traind answered with, or one of the client's own before it could ask.

    code is the symbolic name ("ENOTFOUND"), errno the daemon's negative number, message
    what was wrong, as the daemon said it. The client's own errors (no daemon at the socket,
    a closed connection, a job file that is not JSON) use ECLOSED, EPROTO or EJOB likewise.
    """

    def __init__(self, code, message, errno=None, request_id=None):
        self.code = code
        self.errno = errno if errno is not None else CODES.get(code)
        self.message = message
        self.request_id = request_id
        super().__init__("%s: %s" % (code, message))


def _error_of(frame):
    code = frame.get("code")
    name = frame.get("name") or _NAMES.get(code, "E?")
    return Error(name, frame.get("message", ""), code, frame.get("id"))


def _uid_of(user):
    if user is None or isinstance(user, int):
        return user
    try:
        return pwd.getpwnam(user).pw_uid
    except KeyError:
        raise Error("EINVAL", "user: no user named %r on this machine" % user) from None


def _absolute(path, base):
    if not isinstance(path, str) or path == "" or os.path.isabs(path):
        return path
    if path.startswith("./"):
        path = path[2:]
    return os.path.join(base, path)


def resolve_paths(job, base=None):
    """The job's relative file paths (data.train/valid/test, as a path, a list or
    {images, labels}; model.init_from) made absolute against base (the current directory
    when None), as trainctl does: the daemon's working directory is nobody's."""
    base = base or os.getcwd()
    data = job.get("data")
    if isinstance(data, dict):
        for split in ("train", "test", "valid"):
            v = data.get(split)
            if isinstance(v, str):
                data[split] = _absolute(v, base)
            elif isinstance(v, list):
                data[split] = [_absolute(p, base) for p in v]
            elif isinstance(v, dict):
                for k in ("images", "labels"):
                    if k in v:
                        v[k] = _absolute(v[k], base)
    model = job.get("model")
    if isinstance(model, dict) and "init_from" in model:
        model["init_from"] = _absolute(model["init_from"], base)
    return job


def apply_set(job, key, value):
    """Sets one key of the job, as trainctl's --set KEY=VALUE: key is dotted ("optim.lr"),
    each part but the last an object (made when missing)."""
    parts = key.split(".")
    if any(p == "" for p in parts):
        raise Error("EJOB", "set %s: empty key" % key)
    obj = job
    for p in parts[:-1]:
        child = obj.setdefault(p, {})
        if not isinstance(child, dict):
            raise Error("EJOB", "set %s: '%s' is not an object in the job" % (key, p))
        obj = child
    obj[parts[-1]] = value


def load_job(spec, **set):
    """The job to submit from spec (a dict, or the path of a JSON job file, "-" for standard
    input), a copy with each keyword of set applied (a double underscore stands for a dot:
    optim__lr=1e-3 sets optim.lr) and its relative paths resolved against the current
    directory, as trainctl resolves them."""
    if isinstance(spec, dict):
        job = json.loads(json.dumps(spec))
    else:
        path = os.fspath(spec)
        try:
            if path == "-":
                import sys
                job = json.load(sys.stdin)
            else:
                with open(path, encoding="utf-8") as f:
                    job = json.load(f)
        except OSError as e:
            raise Error("EJOB", "cannot read %s: %s" % (path, e.strerror)) from None
        except ValueError as e:
            raise Error("EJOB", "%s: %s" % (path, e)) from None
        if not isinstance(job, dict):
            raise Error("EJOB", "%s: the job must be a JSON object ({...})" % path)
    for k, v in set.items():
        apply_set(job, k.replace("__", "."), v)
    return resolve_paths(job)


class Client:
    """A connection to traind. socket: the control socket's path; None takes
    $TRAIND_SOCKET, else /run/traind/traind.sock, as trainctl does. timeout: seconds any one
    reply may take (None: no limit; a watch waits as long as its job runs).

    Use as a context manager, or call close()."""

    def __init__(self, socket=None, timeout=None, client_name="traind-python"):
        path = socket or os.environ.get("TRAIND_SOCKET") or DEFAULT_SOCKET
        self.socket_path = path
        self._next_id = 1
        self._buf = b""
        self._sock = _socket.socket(_socket.AF_UNIX, _socket.SOCK_STREAM)
        self._sock.settimeout(timeout)
        try:
            self._sock.connect(path)
        except OSError as e:
            self._sock.close()
            hint = ""
            if not os.environ.get("TRAIND_SOCKET") and socket is None:
                hint = " (is traind running? start it with `systemctl start traind`, or set " \
                       "TRAIND_SOCKET to its socket)"
            raise Error("ECLOSED", "cannot connect to traind at %s: %s%s"
                        % (path, e.strerror or e, hint)) from None
        reply = self._call({"type": "hello", "version": PROTOCOL_VERSION,
                            "client": client_name})
        self.server = reply.get("server")
        self.features = set(reply.get("features") or ())

    # ---- framing ----

    def close(self):
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def _send(self, body):
        if self._sock is None:
            raise Error("ECLOSED", "the client is closed")
        rid = self._next_id
        self._next_id += 1
        frame = msgpack.packb(dict(body, id=rid), use_bin_type=True)
        if len(frame) > FRAME_MAX:
            raise Error("E2BIG", "request of %d bytes exceeds the frame limit of %d bytes"
                        % (len(frame), FRAME_MAX))
        self._sock.sendall(struct.pack(">I", len(frame)) + frame)
        return rid

    def _read_exact(self, n):
        while len(self._buf) < n:
            try:
                chunk = self._sock.recv(max(65536, n - len(self._buf)))
            except _socket.timeout:
                raise Error("ECLOSED", "no reply from traind within the timeout") from None
            if not chunk:
                raise Error("ECLOSED", "traind closed the connection")
            self._buf += chunk
        out, self._buf = self._buf[:n], self._buf[n:]
        return out

    def _recv(self, rid):
        """The next frame for request rid; an error frame (for it, or id -1) raises."""
        while True:
            (length,) = struct.unpack(">I", self._read_exact(4))
            if length > FRAME_MAX:
                raise Error("EPROTO", "frame of %d bytes from traind exceeds the limit" % length)
            frame = msgpack.unpackb(self._read_exact(length), raw=False, strict_map_key=True)
            if not isinstance(frame, dict):
                raise Error("EPROTO", "a frame from traind is not a map")
            if frame.get("type") == "error" and frame.get("id") in (rid, -1):
                raise _error_of(frame)
            if frame.get("id") == rid:
                return frame

    def _call(self, body):
        return self._recv(self._send(body))

    # ---- requests ----

    def submit(self, spec, dry_run=False, **set):
        """Submits a job (a dict, or a JSON job file's path), with keywords as trainctl's
        --set (optim__lr=1e-3 sets optim.lr); returns the new job's id. dry_run=True checks
        it and returns the daemon's estimate (a dict) instead, queueing nothing."""
        body = {"type": "submit", "job": load_job(spec, **set)}
        if dry_run:
            if "dry_run" not in self.features:
                raise Error("EVERSION", "this traind does not know dry runs")
            body["dry_run"] = True
            return self._call(body)
        return self._call(body)["job_id"]

    def status(self, job_id):
        """The job as a dict (PROTOCOL.md's JOB: id, name, uid, state, step, total_steps,
        devices, error, metrics, spec, ...)."""
        return self._call({"type": "status", "job_id": int(job_id)})["job"]

    def jobs(self, state=None, user=None, name=None, since=None, labels=None,
             newest_first=False):
        """Every job that matches, oldest first (newest first with newest_first), read page
        by page: state one of queued, running, succeeded, failed, cancelled (or a list of
        them), user a uid or a user name, name a glob (* ? [a-z]), since unix seconds, labels
        a dict every one of whose name: value pairs the job's labels hold."""
        q = {"type": "list", "limit": LIST_PAGE, "newest_first": bool(newest_first)}
        if labels:
            if "labels" not in self.features:
                raise Error("EVERSION", "this traind does not select jobs by labels")
            q["labels"] = {str(k): str(v) for k, v in labels.items()}
        if state is not None:
            states = [state] if isinstance(state, str) else list(state)
            for s in states:
                if s not in STATES:
                    raise Error("EINVAL", "state: %r is not one of %s" % (s, ", ".join(STATES)))
            q["states"] = states
        uid = _uid_of(user)
        if uid is not None:
            q["uid"] = uid
        if name is not None:
            q["name"] = name
        if since is not None:
            q["since"] = float(since)
        out, after = [], 0
        while True:
            reply = self._call(dict(q, after=after))
            out.extend(reply.get("jobs", []))
            if not reply.get("more"):
                return out
            after = reply["next"]

    def cancel(self, job_id):
        """Cancels the job; returns its state after the request ("cancelled" for a queued
        job, "running" for one that stops at its next step)."""
        return self._call({"type": "cancel", "job_id": int(job_id)})["state"]

    def logs(self, job_id):
        """The job's log, oldest first: a list of (time, level, message), level a syslog
        priority (3 error, 4 warning, 5 notice, 6 info)."""
        out, after = [], 0
        while True:
            reply = self._call({"type": "logs", "job_id": int(job_id), "after": after,
                                "limit": LOGS_PAGE})
            out.extend(tuple(line) for line in reply.get("lines", []))
            if not reply.get("more"):
                return out
            after = reply["next"]

    def watch(self, job_id, keys=None, since=None):
        """The job's metric rows, the stored ones first and then each new one as it becomes
        durable, every row once, in (step, key) order; ends when the job has ended and every
        row has been sent. Each row is a dict {key, step, value, time}. The job as it ended
        (a dict, with its error) is the Watch's .job afterwards; its state changes meanwhile
        are .state."""
        return Watch(self, job_id, keys, since)

    def metrics(self, job_id, keys=None, since=None, frame=None):
        """Every stored row of the job (only keys, when given; from step since), in (step,
        key) order: a pandas DataFrame with columns key, step, value, time when pandas can
        be imported (frame=None) or frame=True, else a list of dicts like watch's. Keys the
        job has no rows of (yet) are named in a warning, with the keys it has."""
        body = {"type": "metrics", "job_id": int(job_id)}
        if keys is not None:
            body["keys"] = [keys] if isinstance(keys, str) else list(keys)
        if since is not None:
            body["since"] = int(since)
        rid = self._send(body)
        rows = []
        while True:
            f = self._recv(rid)
            if f.get("type") == "rows":
                rows.extend(f["rows"])
            elif f.get("type") == "end":
                if f.get("missing"):
                    warnings.warn("job %d has no rows of %s (yet); it has %s"
                                  % (int(job_id), ", ".join(f["missing"]),
                                     ", ".join(f.get("available", [])) or "none"),
                                  stacklevel=2)
                break
        return _rows_out(rows, frame)


def _row(r):
    return {"key": r[0], "step": r[1], "value": r[2], "time": r[3]}


def _rows_out(rows, frame):
    if frame is not False:
        try:
            import pandas
        except ImportError:
            if frame:
                raise
        else:
            return pandas.DataFrame(rows, columns=["key", "step", "value", "time"])
    return [_row(r) for r in rows]


class Watch:
    """The iterator Client.watch returns (see there)."""

    def __init__(self, client, job_id, keys, since):
        body = {"type": "watch", "job_id": int(job_id)}
        if keys is not None:
            body["keys"] = [keys] if isinstance(keys, str) else list(keys)
        if since is not None:
            body["since"] = int(since)
        self._client = client
        self._rid = client._send(body)
        self._pending = []
        self.job = None
        self.state = None

    def __iter__(self):
        return self

    def __next__(self):
        while not self._pending:
            if self.job is not None:
                raise StopIteration
            f = self._client._recv(self._rid)
            t = f.get("type")
            if t == "rows":
                self._pending.extend(f["rows"])
            elif t == "state":
                self.state = {k: f.get(k) for k in ("state", "step", "total_steps")}
            elif t == "end":
                self.job = f.get("job") or {}
        return _row(self._pending.pop(0))
