"""`kvpilot top`: a live terminal view of a running `kvpilot serve`.

`sample.py` reads the server (`/metrics`, `/health`, `/v1/sessions`) into a `Sample`;
`view.py` turns two consecutive samples into the rich view (rates need two).
"""
