"""A class of submissions: grade them all, report on them, and the Gradescope bundle.

==================  ==================================================================
Module              Concept
==================  ==================================================================
:mod:`.batch`       A class folder: plan it (which lab, who, refusals), grade each
                    learner in its own error boundary, ``grades.csv`` (escaped cells),
                    resume from HMAC-signed rows kept outside the learners' folders.
:mod:`.report`      The class's page: scores, named mistakes, per-learner table.
:mod:`.autograder`  The Gradescope bundle and ``run_autograder``: chooses its mode by a
                    self-test of the exact sandbox, writes ``results.json`` last, from
                    the parent, where the learner cannot write.
==================  ==================================================================

Each uses the one-submission grader (:func:`attnlab.grading.grade`) and the sandbox
package (:mod:`attnlab.grading.sandbox`) through their public names only.
"""
