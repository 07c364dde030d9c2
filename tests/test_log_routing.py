"""A plug-in's ``logging`` lines reach what flwr-serverapp sends to the SuperLink (logs/server.log), once each."""

from __future__ import annotations

import ast
import io
import logging
import subprocess
import sys

import pytest
from flwr.supercore import log as flwr_log

from nebula_fl.server.log_routing import RootLogHandler, route_python_logging


@pytest.fixture
def root():
    """The root logger and the quieted libraries as they were, restored after the test."""
    logger = logging.getLogger()
    handlers, level = list(logger.handlers), logger.level
    levels = {name: logging.getLogger(name).level for name in ("httpx", "urllib3")}
    yield logger
    logger.handlers[:] = handlers
    logger.setLevel(level)
    for name, lvl in levels.items():
        logging.getLogger(name).setLevel(lvl)


def test_any_plugin_logger_reaches_the_stream_at_info_and_flower_lines_are_not_doubled(root):
    out = io.StringIO()
    handler = route_python_logging(stream=out)
    logging.getLogger("nebula_krum.scores").info("kept clusters %s", "0, 1, 3")
    logging.getLogger("my-plugin").warning("cluster 2 looks wrong")
    logging.getLogger("my-plugin").debug("not shown")
    flwr_log(logging.INFO, "a Flower line")  # Flower's own handler prints it
    logging.getLogger("httpx").info("HTTP Request: GET /")  # a library's routine line
    lines = out.getvalue().splitlines()
    assert lines == ["INFO :      [nebula_krum.scores] kept clusters 0, 1, 3",
                     "WARNING :   [my-plugin] cluster 2 looks wrong"]  # as Flower lays out its own lines
    assert route_python_logging(stream=io.StringIO()) is handler  # installed once
    assert sum(isinstance(h, RootLogHandler) for h in root.handlers) == 1


def test_a_root_level_set_lower_already_is_kept(root):
    root.setLevel(logging.DEBUG)
    route_python_logging(stream=io.StringIO())
    assert root.level == logging.DEBUG


def test_in_a_process_that_mirrors_its_output_as_flwr_serverapp_does_each_line_is_sent_once():
    """Flower's flwr-serverapp mirrors stdout/stderr into a queue that it uploads to the SuperLink; `flwr run
    --stream` prints it into logs/server.log. The same mirror, in a fresh process, after the route is installed."""
    code = """
import logging
from queue import Queue
from flwr.supercore import log
from flwr.supercore.logger import mirror_output_to_queue
from nebula_fl.server.log_routing import route_python_logging
queue = Queue()
mirror_output_to_queue(queue)
route_python_logging()
logging.getLogger("nebula_trimmed_mean").info("trimmed mean of 3 updates")
log(logging.INFO, "[ROUND 1/2]")
sent = []
while not queue.empty():
    sent.append(queue.get())
import sys
sys.__stderr__.write("SENT:" + repr("".join(sent)))
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    sent = ast.literal_eval(done.stderr.rsplit("SENT:", 1)[1])
    assert sent.count("[nebula_trimmed_mean] trimmed mean of 3 updates") == 1
    assert sent.count("[ROUND 1/2]") == 1
