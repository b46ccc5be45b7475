"""The PDCluster CRD generated from the models (pure).

crdgen (the CustomResourceDefinition), structural (pydantic schema →
structural schema), cel_rules (CEL validation rules), field_docs (field
descriptions for `kubectl explain`), refdoc (docs/reference.md).
"""
