"""HTTP edges every server of the runtime shares (worker, bootstrap, router).

Bearer auth, input limits, the answer to an HTTP/2 preface.
"""
