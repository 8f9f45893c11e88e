"""The one error of the privacy layer: a configuration it cannot make private, with the reason."""


class PrivacyRefused(ValueError):
    """A job, step or payload that cannot get the differential privacy it asks for; the message
    says why (a field without an L2 bound, a target no noise level meets, no ring wide enough)."""
