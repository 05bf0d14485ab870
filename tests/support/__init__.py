"""What tests and benchmarks share: free ports, real server processes, replicated clusters.

One copy of each helper, so a fix (a port race, a slower start) reaches every user.
"""
