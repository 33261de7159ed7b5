"""`kvray bench pd`: prefill/decode disaggregation against colocated replicas."""
