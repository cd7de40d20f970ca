"""traind, the training daemon, from Python: submit jobs, follow their metrics, read their
logs, over its control socket (proto/PROTOCOL.md). Needs msgpack; pandas is optional
(Client.metrics returns a DataFrame when it is there).

    import traind
    with traind.Client() as c:
        job = c.submit("job.json", max_steps=300)
        for row in c.watch(job, keys=["train_loss"]):
            print(row["step"], row["value"])
"""

from traind.client import CODES, DEFAULT_SOCKET, Client, Error, Watch, load_job

__version__ = "0.1.0"
__all__ = ["Client", "Error", "Watch", "load_job", "CODES", "DEFAULT_SOCKET", "__version__"]
