"""The cost room: what an optimizer step costs. Matrix sets (``shapes``, ``matrices``), the
``timing`` command (``timing``, ``timing_run``, ``timing_report``), derived and measured payload
(``payload``, ``payload_command``), training-loop step time (``looptime``) and the roofline
(``roofline``).
"""
