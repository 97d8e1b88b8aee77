"""The quotation verifier V(e, C), evidence-tag parsing and the evidence-format term f.
Standard library only; imports nothing from the project."""
