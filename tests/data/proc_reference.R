# Reference values for tests/test_roc_compare.py, from R 4.2 with pROC 1.18.0:
#   Rscript tests/data/proc_reference.R            (run from the repository root)
# prints the scalar references the tests hold (paired / unpaired DeLong tests, partial AUCs) and
# writes tests/data/proc_coords.csv (coords(roc, "all") and the best thresholds). Every curve is
# built with direction = "<" (controls lower), as secagg-roc fixes it. The tests do not need R.
suppressMessages(library(pROC))
asah <- read.csv("secagg_roc/datasets/aSAH.csv")
# Random data with heavy ties (drawn once with numpy; scores A / 10, B / 5 and C / 3).
Y <- c(1, 1, 1, 1, 0, 1, 1, 1, 0, 1, 0, 1, 0, 0, 1, 1, 0, 1, 0, 1, 1, 0, 1, 1, 1, 1, 0, 1, 0, 0, 0, 1, 1, 0, 1, 1, 0, 0, 0, 0, 0, 1, 1, 1, 1, 0, 1, 0, 0, 0, 1, 1, 1, 1, 0, 1, 0, 1, 0, 0)
A <- c(4, 3, 6, 5, 4, 10, 8, 1, 6, 6, 1, 8, 5, 9, 1, 7, 8, 5, 5, 5, 5, 6, 4, 7, 6, 5, 5, 8, 3, 5, 5, 7, 3, 8, 8, 4, 4, 3, 5, 5, 8, 7, 5, 4, 5, 5, 4, 0, 7, 5, 8, 7, 6, 8, 9, 7, 5, 7, 4, 7) / 10
B <- c(3, 2, 4, 4, 3, 3, 3, 3, 2, 3, 2, 3, 3, 3, 1, 2, 4, 2, 2, 4, 4, 3, 4, 2, 4, 4, 3, 3, 3, 3, 2, 4, 1, 3, 3, 3, 1, 3, 3, 3, 3, 4, 4, 3, 2, 3, 2, 2, 3, 3, 3, 4, 3, 4, 4, 4, 3, 2, 2, 3) / 5
Y2 <- c(0, 0, 1, 1, 0, 1, 0, 1, 1, 0, 1, 0, 1, 1, 0, 1, 1, 0, 1, 0, 1, 1, 0, 0, 1, 1, 1, 1, 1, 1, 0, 1, 0, 0, 1, 0, 0, 0, 1, 0)
C <- c(0, 0, 2, 3, 0, 2, 2, 2, 3, 0, 1, 0, 1, 0, 2, 1, 2, 1, 1, 2, 1, 1, 1, 0, 0, 3, 3, 2, 2, 0, 2, 0, 1, 1, 1, 2, 0, 1, 1, 1) / 3
y <- as.integer(asah$outcome == "Poor")
curve <- function(labels, score) roc(labels, score, levels = c(0, 1), direction = "<", quiet = TRUE)
f <- function(x) sprintf("%.17g", x)
test <- function(name, r1, r2, r2u = r2) {
  p <- roc.test(r1, r2, method = "delong", paired = TRUE)
  u <- suppressWarnings(roc.test(r1, r2u, method = "delong", paired = FALSE))
  cat(sprintf('    "%s": dict(z=%s, p=%s, auc1=%s, auc2=%s, ci=(%s, %s), var1=%s, var2=%s, cov=%s,\n',
              name, f(p$statistic), f(p$p.value), f(p$estimate[1]), f(p$estimate[2]), f(p$conf.int[1]),
              f(p$conf.int[2]), f(var(r1, method = "delong")), f(var(r2, method = "delong")),
              f(cov(r1, r2, method = "delong"))))
  cat(sprintf('               d=%s, df=%s, p_unpaired=%s, p_greater=%s, p_less=%s),\n', f(u$statistic),
              f(u$parameter), f(u$p.value),
              f(roc.test(r1, r2, method = "delong", paired = TRUE, alternative = "greater")$p.value),
              f(suppressWarnings(roc.test(r1, r2u, method = "delong", paired = FALSE, alternative = "less"))$p.value)))
}
cat("DELONG = {\n")
test("asah s100b ndka", curve(y, asah$s100b), curve(y, asah$ndka))
test("asah wfns s100b", curve(y, asah$wfns), curve(y, asah$s100b))
test("ties A B", curve(Y, A), curve(Y, B))
cat("}\n")
# An unpaired test of two cohorts: A on Y against C on Y2.
u <- roc.test(curve(Y, A), curve(Y2, C), method = "delong", paired = FALSE)
cat(sprintf("COHORTS = dict(d=%s, df=%s, p=%s)\n", f(u$statistic), f(u$parameter), f(u$p.value)))
cat("PARTIAL = [\n")
sets <- list("asah s100b" = list(y, asah$s100b), "asah ndka" = list(y, asah$ndka), "asah wfns" = list(y, asah$wfns),
             "ties A" = list(Y, A), "ties B" = list(Y, B), "ties C" = list(Y2, C))
for (nm in names(sets)) {
  r <- curve(sets[[nm]][[1]], sets[[nm]][[2]])
  for (rg in list(c(1, .8), c(.9, .5), c(.75, .7), c(.3, 0), c(1, 0))) for (foc in c("specificity", "sensitivity")) {
    a <- auc(r, partial.auc = rg, partial.auc.focus = foc)
    b <- suppressWarnings(auc(r, partial.auc = rg, partial.auc.focus = foc, partial.auc.correct = TRUE))
    cat(sprintf('    ("%s", (%g, %g), "%s", %s, %s),\n', nm, rg[2], rg[1], foc, f(a), ifelse(is.na(b), "None", f(b))))
  }
}
cat("]\n")
rows <- NULL
for (nm in names(sets)) {
  r <- curve(sets[[nm]][[1]], sets[[nm]][[2]])
  all <- coords(r, "all", ret = c("threshold", "specificity", "sensitivity", "ppv", "npv", "tp", "fp", "tn", "fn"))
  rows <- rbind(rows, data.frame(set = nm, kind = "all", all))
  for (m in c("youden", "closest.topleft")) {
    b <- coords(r, "best", best.method = m, ret = c("threshold", "specificity", "sensitivity", "ppv", "npv", "tp", "fp", "tn", "fn"))
    rows <- rbind(rows, data.frame(set = nm, kind = m, b))
  }
}
num <- sapply(rows, is.numeric)
rows[num] <- lapply(rows[num], function(x) ifelse(is.na(x), "NA", sprintf("%.17g", x)))
write.csv(rows, "tests/data/proc_coords.csv", row.names = FALSE, quote = FALSE)
