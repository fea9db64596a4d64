import re,sys,glob,datetime
# Setup time of each hop: from the moment a host had the session (head: "chain session started";
# others: first "session accepted") to its forwarder's first "downstream accepted" (or "failing over").
def ts(line):
    m=re.match(r'(\S+Z)',line); 
    return datetime.datetime.fromisoformat(m.group(1).replace('Z','+00:00')).timestamp() if m else None
out=[]
for d in sys.argv[1:]:
    for log in sorted(glob.glob(d+'/*/transferd.log')):
        t0=None; t1=None
        for line in open(log, errors='replace'):
            line=re.sub(r'\x1b\[[0-9;]*m','',line)
            if t0 is None and ('chain session started' in line or 'session accepted' in line): t0=ts(line)
            if t0 is not None and t1 is None and ('downstream accepted' in line or 'failing over' in line): t1=ts(line)
        if t0 and t1: out.append(round((t1-t0)*1000))
print(out)
