"""POST a reward query to a URL from whichever node runs this: ``probe_http.py URL [KEY]``; prints the status and
the first 200 characters of the answer (or the connection error) as JSON."""

import json
import sys

import httpx

url, key = sys.argv[1], (sys.argv[2] if len(sys.argv) > 2 else None)
headers = {"Authorization": f"Bearer {key}"} if key else {}
try:
    answer = httpx.post(url, json={"query": ["1+1=2"]}, headers=headers, timeout=20)
    print(json.dumps({"status": answer.status_code, "body": answer.text[:200]}))
except httpx.HTTPError as err:
    print(json.dumps({"status": None, "body": f"{type(err).__name__}: {err}"}))
