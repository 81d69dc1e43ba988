"""allreduce.runtime"""
