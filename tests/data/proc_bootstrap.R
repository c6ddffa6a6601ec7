# Reference values for tests/test_bootstrap.py, from R 4.2 with pROC 1.18.0:
#   Rscript tests/data/proc_bootstrap.R            (run from the repository root; about two minutes)
# Curves on aSAH (outcome "Poor" = 1, score s100b) with direction = "<", as secagg-roc fixes it.
# Prints: (1) pROC's stratified percentile bootstrap intervals at boot.n = 200000 (their Monte-Carlo
# error is negligible next to a 2000-replicate run's), (2) the spread (standard deviation over 40 seeds)
# of the interval ends of 2000-replicate runs, which sets the tests' tolerances, and (3) coords()'s
# sensitivity at fixed specificities (exact matches and interpolations) on the data and on a
# deterministic resample (record i repeated (i * 7) %% 4 times), which the exact arithmetic must hit.
# The tests do not need R.
suppressMessages(library(pROC))
asah <- read.csv("secagg_roc/datasets/aSAH.csv")
y <- as.integer(asah$outcome == "Poor")
s <- asah$s100b
curve <- function(labels, score) roc(labels, score, levels = c(0, 1), direction = "<", quiet = TRUE)
f <- function(x) sprintf("%.17g", x)
r <- curve(y, s)
set.seed(20240601)
big_auc <- ci.auc(r, method = "bootstrap", boot.n = 200000, boot.stratified = TRUE, progress = "none")
big_se <- ci.se(r, specificities = 0.9, boot.n = 200000, boot.stratified = TRUE, progress = "none")
cat(sprintf("PROC_AUC = dict(estimate=%s, lower=%s, median=%s, upper=%s)\n", f(auc(r)), f(big_auc[1]), f(big_auc[2]),
            f(big_auc[3])))
cat(sprintf("PROC_SE90 = dict(estimate=%s, lower=%s, median=%s, upper=%s)\n",
            f(coords(r, 0.9, input = "specificity", ret = "sensitivity")[1, 1]), f(big_se[1, 1]), f(big_se[1, 2]),
            f(big_se[1, 3])))
ends <- t(sapply(1:40, function(k) {
  set.seed(k)
  a <- ci.auc(r, method = "bootstrap", boot.n = 2000, boot.stratified = TRUE, progress = "none")
  b <- ci.se(r, specificities = 0.9, boot.n = 2000, boot.stratified = TRUE, progress = "none")
  c(a[1], a[3], b[1, 1], b[1, 3])
}))
sds <- apply(ends, 2, sd)
cat(sprintf("PROC_MC_SD_2000 = dict(auc_lower=%s, auc_upper=%s, se_lower=%s, se_upper=%s)\n",
            f(sds[1]), f(sds[2]), f(sds[3]), f(sds[4])))
sp <- c(0.3, 0.5, 0.75, 0.8, 0.9, 0.95, 37 / 72, 63 / 72)
w <- (seq_along(y) * 7) %% 4
rw <- curve(rep(y, w), rep(s, w))
cat(sprintf("PROC_SE_AT = dict(sp=[%s],\n    plain=[%s],\n    resampled=[%s])\n",
            paste(f(sp), collapse = ", "),
            paste(f(coords(r, sp, input = "specificity", ret = "sensitivity")[, 1]), collapse = ", "),
            paste(f(coords(rw, sp, input = "specificity", ret = "sensitivity")[, 1]), collapse = ", ")))
cat(sprintf("PROC_AUC_RESAMPLED = %s\n", f(auc(rw))))
