"""Task module for the schedule tests: one task, and the schedules the test declares in
SCHEDULES_UNDER_TEST (a JSON list of runstile.schedule keyword arguments)."""

import json
import os

import runstile


@runstile.task("tick")
def tick(ctx, input):
    return {"input": input}


for declaration in json.loads(os.environ.get("SCHEDULES_UNDER_TEST", "[]")):
    runstile.schedule(**declaration)
