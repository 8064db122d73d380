"""A `setdiff serve` subprocess on 127.0.0.1, for the tests and the serving benchmark: started
on a free port, up once /health answers, and stopped (and waited for) by `stop`."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from setdiff_megatron.distributed.runtime import free_port

__all__ = ["LiveServer"]


class LiveServer:
    def __init__(self, source: str | Path, *args: str, model_name: str = "model", timeout: float = 240):
        import openai

        self.port, self.model_name = free_port(), model_name
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "setdiff_megatron.cli",
                "serve",
                str(source),
                "--port",
                str(self.port),
                "--model-name",
                model_name,
                *args,
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env={**os.environ, "TOKENIZERS_PARALLELISM": "false"},
        )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited: {self.proc.stdout.read()[-3000:]}")
            try:
                if json.loads(urllib.request.urlopen(self.url + "/health", timeout=2).read())["status"] == "ok":
                    break
            except OSError:
                time.sleep(0.3)
        else:
            self.stop()
            raise RuntimeError("the server did not answer /health")
        self.client = openai.OpenAI(base_url=self.url + "/v1", api_key="none", max_retries=0, timeout=300)

    def metrics(self) -> dict[str, float]:
        text = urllib.request.urlopen(self.url + "/metrics", timeout=5).read().decode()
        return {line.split()[0]: float(line.split()[1]) for line in text.splitlines() if not line.startswith("#")}

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=60)
