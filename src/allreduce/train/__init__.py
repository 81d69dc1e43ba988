"""allreduce.train"""
