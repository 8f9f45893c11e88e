"""Differential privacy of the released sums: central (the coordinator adds Gaussian noise) or
distributed (each device adds its share of discrete Gaussian noise inside the secure sum).

Modules: ``randomness`` (CSPRNG noise), ``rotation`` (randomized Hadamard), ``planning`` (scale,
noise share and ring width), ``mechanisms`` (what devices and server do), ``sensitivity`` (which
fields can be bounded), ``payload`` (the device side), ``server`` (the server wrapper),
``accounting`` (dp-accounting ledger), ``spec`` (the job spec's ``privacy:`` section),
``metrics`` (``tally_privacy_*``). Import the submodules: devices do not install the accountant.
"""
