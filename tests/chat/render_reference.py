"""Reference renderings for spindle's chat template tests: Python jinja2 in transformers' exact
environment (hfenv.py from the template corpus), with strftime_now pinned to a fixed date.

usage: render_reference.py HFENV_DIR CASES.json OUT.json
CASES.json: {"now": [y, m, d, H, M], "cases": [{"template": str, "context": {...}}]}
OUT.json: [{"text": str} | {"error": str}] in case order.
"""
import json
import sys
from datetime import datetime

sys.path.insert(0, sys.argv[1])
import hfenv  # noqa: E402

request = json.load(open(sys.argv[2], encoding="utf-8"))
fixed_now = datetime(*request["now"])
hfenv.ENV.globals["strftime_now"] = lambda fmt: fixed_now.strftime(fmt)
compiled = {}
results = []
for case in request["cases"]:
    try:
        source = case["template"]
        if source not in compiled:
            compiled[source] = hfenv.ENV.from_string(source)
        results.append({"text": compiled[source].render(**case["context"])})
    except Exception as error:  # every failure is a result the C++ side must reproduce as an error
        results.append({"error": f"{type(error).__name__}: {error}"})
json.dump(results, open(sys.argv[3], "w", encoding="utf-8"), ensure_ascii=False)
