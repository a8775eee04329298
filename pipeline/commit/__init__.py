"""The commit protocol: work units (a file's row range), the output location (files, then a
marker per unit; cleanup; stats), and the lease that lets one run at a time write there."""
